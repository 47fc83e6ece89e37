"""Every compared training step as a `StepLoop`: a step, its own state, its batches.

All variants start from the same initial params (the trainer's seed-derived init) and cycle
through the same few global batches, already placed on the devices the way each variant wants
them, so the timed loop contains the step and nothing else. Building a loop runs its first
step under `CompileEvents`, which records what the first call cost (trace, lowering, XLA
compilation, execution).

Names used in the report:

* ``xshard_trainer`` — `trainers.Trainer.step`, manual (shard_map) gradients, full statistics,
  optimizer from the config (adam, constant rate, MEAN, non-finite guard on).
* ``xshard_trainer_stats10`` — `Trainer.step` with the statistics on every 10th step only,
  what `trainer.stats_every=${trainer.log_every}` (10) gives the CLI by default.
* ``xshard_trainer_gspmd`` — the same with ``grad_impl="gspmd"``.
* ``xshard_trainer_gspmd_stats10`` — ``grad_impl="gspmd"`` with the statistics on every 10th
  step: the other gradient path at the CLI's cadence.
* ``xshard_guard`` — `cross_shard(optax.adam, track_stats=False, skip_nonfinite=True)` in
  shard_map, loss only: the library with its non-finite guard, no trainer statistics.
* ``xshard_nostats`` — the same with the guard off: the library's reduction alone.
* ``jit_gspmd`` / ``pmap_pmean`` — the hand-written baselines of `benchmarks.baselines`.
* ``xshard_trainer+layer_stats`` / ``+histograms`` — `Trainer.step` computing per-layer norms
  (and gradient histograms) of its own gradient on every step, fetched to the host as
  `Trainer.fit` does: the cost of a step that logs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import baselines
from benchmarks.compile_events import CompileEvents
from benchmarks.workloads import DATA_AXIS, Workload
from trainers.core.step import HISTOGRAMS, LAYERS, STATS
from trainers.core.trainer import Trainer
from trainers.tasks.sharding import param_shardings
from xshard import cross_shard
from xshard.optim.packed import tree_map_params

HANDWRITTEN = ("jit_gspmd", "pmap_pmean")


@dataclasses.dataclass
class StepLoop:
    """A step with its own state and batches, which the timer drives block by block.

    Attributes:
      name: the variant's name in the report.
      step: ``step(state, batch) -> (state, outputs)``; may donate `state`.
      state: the current state (replaced after every step).
      batches: device-placed batches, cycled.
      compiled: returns the step's compiled executable (for its HLO and memory analysis).
      params: returns the params inside a state; opt_state: its optimizer state.
      first_call: the `CompileEvents` of the first step (filled by `start`).
      trainer: the `Trainer`, for the trainer variants.
      jitted: the ``jax.jit`` function, for the hand-written jit variant (its cache size).
    """

    name: str
    step: Callable[[Any, Any], tuple[Any, Any]]
    state: Any
    batches: list[Any]
    compiled: Callable[[], jax.stages.Compiled]
    params: Callable[[Any], Any]
    opt_state: Callable[[Any], Any]
    first_call: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainer: Trainer | None = None
    jitted: Any = None
    _next: int = 0
    _executable: jax.stages.Compiled | None = None

    def run(self, steps: int) -> None:
        """Runs `steps` steps, then blocks on the last state and outputs."""
        out = None
        for _ in range(steps):
            batch = self.batches[self._next % len(self.batches)]
            self._next += 1
            self.state, out = self.step(self.state, batch)
        jax.block_until_ready((self.state, out))

    def executable(self) -> jax.stages.Compiled:
        """The compiled step (cached: hand-written variants lower and compile it again)."""
        if self._executable is None:
            self._executable = self.compiled()
        return self._executable

    def start(self) -> StepLoop:
        """Runs the first step (compiling it) and records what that cost."""
        with CompileEvents() as events:
            self.run(1)
        self.first_call = events.as_dict()
        seconds = None if self.trainer is None else self.trainer.compile_seconds
        if seconds is not None and events.compiles:  # this loop's first step compiled
            self.first_call["trainer_compile_seconds"] = round(seconds, 4)
        return self


# --------------------------------------------------------------------------------------------
# xshard: the trainer
# --------------------------------------------------------------------------------------------


def make_trainer(wl: Workload, mesh: Mesh, grad_impl: str = "manual") -> Trainer:
    """The `Trainer` the CLI would build for `wl` on `mesh` (it reduces as the optimizer
    says: the config's ``reduction`` node)."""
    return Trainer(
        wl.task,
        wl.xshard_optimizer(mesh),
        mesh,
        data_axes=(DATA_AXIS,),
        global_batch_size=wl.global_batch_size,
        microbatches=int(wl.cfg.trainer.microbatches),
        grad_impl=grad_impl,
        seed=int(wl.cfg.seed),
    )


def compiled_step(trainer: Trainer, level: int) -> jax.stages.Compiled:
    """The trainer's AOT-compiled step for steps of `level`."""
    compiled = trainer.executable_for(level)
    if compiled is None:
        raise RuntimeError(f"the trainer has not compiled level {level} yet: call step() first")
    return compiled


def trainer_loop(
    name: str,
    wl: Workload,
    trainer: Trainer,
    params: Any,
    level: int | Callable[[int], int] = STATS,
) -> StepLoop:
    """`Trainer.step` on its own fresh state, every step at `level` (see `trainers.core.step`).

    Args:
      name: the variant's name.
      wl: the workload.
      trainer: the trainer (several loops may share one, and so its compiled steps).
      params: initial params (host arrays).
      level: the level of every step, or a function of the step's 1-based count (e.g.
        statistics on every 10th step, with a period dividing 100). Steps that log per-layer
        statistics fetch them to the host as `Trainer.fit` does: one step late, after the
        next step is dispatched (the last one's when its block ends). The first step compiles
        the executables of every level the loop runs, as `Trainer.fit` does before its first.
    """
    level_of = level if callable(level) else (lambda _: level)
    levels = {level_of(i) for i in range(1, 101)}
    count = iter(range(1, 1 << 62))
    logged: list[Any] = []  # the previous step's metrics, if it logs per-layer statistics

    def step(state, batch):
        i = next(count)
        if i == 1:
            trainer.compile_levels(state, batch, levels)
        lv = level_of(i)
        state, metrics = trainer.step(
            state,
            batch,
            with_stats=lv >= STATS,
            layer_stats=lv >= LAYERS,
            histograms=lv >= HISTOGRAMS,
        )
        while logged:
            logged.pop().diagnostics  # noqa: B018 - fetched one step late, as fit does
        if lv >= LAYERS:
            logged.append(metrics)
        return state, metrics

    return StepLoop(
        name=name,
        step=step,
        state=trainer.init(params),
        batches=[trainer.global_batch(b) for b in wl.host_batches],
        compiled=lambda: compiled_step(trainer, level_of(1)),
        params=lambda s: s.params,
        opt_state=lambda s: s.opt_state,
        trainer=trainer,
    ).start()


# --------------------------------------------------------------------------------------------
# Hand-written steps and cross_shard without the trainer
# --------------------------------------------------------------------------------------------


def _placed_state(wl: Workload, mesh: Mesh, params: Any, opt: optax.GradientTransformation):
    """Params placed by the task's sharding rules, optimizer state sharded like them."""
    replicated = NamedSharding(mesh, P())
    params_sh = param_shardings(params, wl.task.sharding_rules, mesh)
    opt_sh = tree_map_params(
        opt,
        lambda _, sharding: sharding,
        jax.eval_shape(opt.init, params),
        params_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    placed = jax.device_put(params, params_sh)
    return placed, jax.jit(opt.init, out_shardings=opt_sh)(placed), (params_sh, opt_sh)


def _global_batches(wl: Workload, mesh: Mesh) -> tuple[NamedSharding, list[Any]]:
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    batches = [
        jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), b)
        for b in wl.host_batches
    ]
    return sharding, batches


def _three_to_two(fn: Callable) -> Callable:
    """Adapts ``fn(params, opt_state, batch) -> (params, opt_state, loss)`` to a `StepLoop`."""

    def step(state, batch):
        params, opt_state, loss = fn(*state, batch)
        return (params, opt_state), loss

    return step


def jit_loop(wl: Workload, mesh: Mesh, params: Any) -> StepLoop:
    """The MaxText-style hand-written step (`baselines.jit_step`)."""
    opt = wl.plain_optimizer()
    p, o, shardings = _placed_state(wl, mesh, params, opt)
    batch_sh, batches = _global_batches(wl, mesh)
    fn = baselines.jit_step(wl.task, opt, shardings, batch_sh)
    loop = StepLoop(
        name="jit_gspmd",
        step=_three_to_two(fn),
        state=(p, o),
        batches=batches,
        compiled=lambda: fn.lower(*loop.state, batches[0]).compile(),
        params=lambda s: s[0],
        opt_state=lambda s: s[1],
    )
    loop.jitted = fn
    return loop.start()


def pmap_loop(wl: Workload, devices: list[Any], params: Any) -> StepLoop:
    """The flax-examples-style hand-written step (`baselines.pmap_step`)."""
    opt = wl.plain_optimizer()
    fn = baselines.pmap_step(wl.task, opt, devices, DATA_AXIS)
    p = baselines.replicate(params, devices, DATA_AXIS)
    o = jax.pmap(opt.init, axis_name=DATA_AXIS, devices=devices)(p)
    batches = [baselines.split_for_pmap(b, devices, DATA_AXIS) for b in wl.host_batches]
    loop = StepLoop(
        name="pmap_pmean",
        step=_three_to_two(fn),
        state=(p, o),
        batches=batches,
        compiled=lambda: fn.lower(*loop.state, batches[0]).compile(),
        params=lambda s: s[0],
        opt_state=lambda s: s[1],
    )
    return loop.start()


def shard_map_loop(name: str, wl: Workload, mesh: Mesh, params: Any, *, guard: bool) -> StepLoop:
    """`xshard.cross_shard` (statistics off) in a hand-written shard_map step."""
    tx = cross_shard(
        wl.plain_optimizer(),
        wl.cfg.reduction.mode,
        axis_name=DATA_AXIS,
        track_stats=False,
        skip_nonfinite=guard,
    )
    p, o, _ = _placed_state(wl, mesh, params, tx)
    state_sh = jax.tree.map(lambda x: x.sharding, (p, o))
    batch_sh, batches = _global_batches(wl, mesh)
    fn = baselines.shard_map_step(wl.task, tx, mesh, state_sh, batch_sh, (DATA_AXIS,))
    loop = StepLoop(
        name=name,
        step=fn,
        state=(p, o),
        batches=batches,
        compiled=lambda: fn.lower(loop.state, batches[0]).compile(),
        params=lambda s: s[0],
        opt_state=lambda s: s[1],
    )
    return loop.start()
