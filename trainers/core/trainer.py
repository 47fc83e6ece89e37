"""The generic pjit trainer: `init` / `step` / `fit`, over any task and any cross-shard optimizer.

Read top to bottom: placement of params and batches on the mesh, the step program (compiled
per kind of step by `trainers.core.programs`), a periodic axis's programs
(`trainers.core.periodic_programs`), then `fit`, whose loop lives in `trainers.core.loop`
(two steps in flight at most, lag-one metrics, stops agreed between processes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.hook import Hook, StopTraining
from trainers.core.loop import FitLoop
from trainers.core.metrics import COMPILE_TIME, StepMetrics, pack_diagnostics, stack_metrics
from trainers.core.model_state import init_fn
from trainers.core.periodic import Periodic
from trainers.core.periodic_programs import PeriodicPrograms
from trainers.core.precision import Precision
from trainers.core.programs import ProgramKey, StepPrograms, Traced
from trainers.core.step import (
    HISTOGRAMS,
    LAYERS,
    LEVELS,
    PLAIN,
    STATS,
    TrainState,
    make_train_step,
)
from trainers.core.step_tx import (
    as_cross_shard,
    periodic_inner_axes,
    refuse_nested_cross_shard,
    step_spec,
)
from trainers.core.stop_vote import STOP_VOTE_KEY, StopVote
from trainers.core.zero import zero_layout
from xshard.axis_reduce import state_partition_specs
from xshard.axis_rules import AxisRule
from xshard.errors import ConfigError
from xshard.layer_stats import leaf_names
from xshard.reduce import PerShardGradientsRequired
from xshard.reduction_mode import Reduction

__all__ = ["Hook", "StopTraining", "StopVote", "Trainer"]

logger = logging.getLogger(__name__)


# Folded into the seed for parameter init; steps fold in 0, 1, 2, ... and never reach it.
_INIT_STREAM = 0x7FFFFFFF


class Trainer:
    """Trains `task` with the optimizer `tx` on `mesh`.

    Args:
      task: a `trainers.tasks.base.Task`.
      tx: the optimizer, normally from `xshard.build_optimizer` or `xshard.cross_shard` (a
        `xshard.optimizer.CrossShardTransformation`, which reduces the gradients and records
        the statistics). A plain optax optimizer works too: the trainer wraps it once, in
        ``cross_shard(tx, reduction, axis_name=data_axes)``, and reports the same statistics,
        except the skip counters (it skips nothing). A transformation that holds a
        `cross_shard` inside (``optax.chain(cross_shard(...), ...)``) is refused by `init`:
        put the other transformations inside the `cross_shard` instead.
      mesh: the device mesh.
      data_axes: the data-parallel mesh axes (the batch is split and gradients reduced over
        them); other axes are model axes, used by the task's sharding rules.
      global_batch_size: examples per step over all shards.
      microbatches: gradient accumulation steps per update.
      grad_impl: "manual" (per-shard gradients in shard_map) or "gspmd".
      reduction: how a plain optax `tx` is reduced (None: MEAN, ``pmean``); a `cross_shard`
        optimizer reduces as it was built, and a `reduction` given with it must agree.
      seed: the run's seed (step RNGs are derived from it and the step).
      agree_stop: whether the processes agree on stops within the steps (default: with more
        than one process); see `fit`. One process needs no vote: its step takes none.
      zero_stage: ``sharding.zero_stage``: 0 replicated over the data axes, 1 optimizer state
        sharded over them, 2 also the gradient reduce-scattered, 3 also the params at rest
        (`trainers.core.zero`, docs/scaling.md).
      periodic: ``(axis, rule)``: a data axis whose replicas train alone and sync every
        ``rule.every_steps`` steps through ``rule.outer_optimizer`` (local SGD, DiLoCo;
        `trainers.core.periodic`); `tx` must then reduce over the other data axes only.
      precision: the dtypes of the params (and optimizer state, checkpoints) and of the
        forward and backward passes (`trainers.core.precision`; default: float32 for both).

    Each kind of step (plain, statistics, per-layer norms, histograms: `trainers.core.step`'s
    levels) has its own compiled program (docs/benchmarks.md measured the alternatives
    slower), compiled when a step first needs it: the first step waits for one program, not
    for all of them (time to the first step, measured in docs/benchmarks.md). `compile_levels`
    compiles several ahead of time, concurrently.

    Raises:
      ConfigError: for a batch not divisible over the data shards, a bad microbatch count or
        `grad_impl`.
      ValueError: for a `reduction` that disagrees with a `cross_shard` optimizer's.
    """

    def __init__(
        self,
        task: Any,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        *,
        data_axes: Sequence[str] = ("data",),
        global_batch_size: int,
        microbatches: int = 1,
        grad_impl: str = "manual",
        reduction: Reduction | str | None = None,
        seed: int = 0,
        agree_stop: bool | None = None,
        zero_stage: int = 0,
        periodic: tuple[str, AxisRule] | None = None,
        precision: Precision | None = None,
    ):
        data_axes = tuple(data_axes)
        self.precision = Precision() if precision is None else precision
        self.task, self.mesh = task, mesh
        #: The periodic axis (`trainers.core.periodic`), or None.
        self.periodic = None if periodic is None else Periodic(mesh, *periodic)
        #: The data axes each replica reduces over every step (all without a periodic axis).
        inner_axes = periodic_inner_axes(data_axes, periodic)
        #: The optimizer as the step runs it: `tx`, or a plain optax `tx` wrapped once.
        self.tx = as_cross_shard(tx, reduction, inner_axes)
        self.spec = step_spec(
            mesh,
            data_axes,
            inner_axes,
            self.periodic,
            global_batch_size=global_batch_size,
            microbatches=microbatches,
            grad_impl=grad_impl,
            seed=seed,
        )
        # The rules are read once the params exist (a Flax task's come from its model).
        self.layout = zero_layout(zero_stage, mesh, inner_axes, lambda: task.sharding_rules)
        self.batch_sharding = NamedSharding(mesh, P(data_axes))
        # A replica's step sees the mesh with the periodic axis manual.
        step_mesh = mesh if self.periodic is None else self.periodic.replica_mesh()
        step_layout = zero_layout(zero_stage, step_mesh, inner_axes, lambda: task.sharding_rules)
        # A step function per level. Validates grad_impl now (ConfigError), not at the first
        # step. A periodic axis's warm-up steps: the same step reducing over that axis too.
        build = lambda tx: {  # noqa: E731
            lv: make_train_step(task, tx, step_mesh, self.spec, lv, step_layout, self.precision)
            for lv in LEVELS
        }
        self._step_fns = build(self.tx)
        self._warmup_fns = {}
        if self.periodic is not None and self.periodic.rule.warmup_steps:
            self._warmup_fns = build(self.periodic.warmup_tx(self.tx, grad_impl, zero_stage))
        #: The periodic axis's sync and warm-up switch programs, or None.
        self.periodic_programs = None if self.periodic is None else PeriodicPrograms(self.periodic)
        #: The compiled step programs, each compiled when a step first needs it.
        self.programs = StepPrograms()
        self._replicated = NamedSharding(mesh, P())
        self.agree_stop = jax.process_count() > 1 if agree_stop is None else bool(agree_stop)
        # One vote per device, each process filling its own devices (`_votes`).
        self._vote_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        self._vote_arrays: dict[int, jax.Array] = {}
        self.compile_seconds: float | None = None
        self._report_compile = False
        #: After `fit` with agreed stops: the vote that stopped it, or None.
        self.agreed_stop: StopVote | None = None

    # ------------------------------------------------------------------ placement

    def param_shardings(self, params: Any) -> Any:
        """NamedShardings of `params` at rest: the task's sharding rules, and with
        ``zero_stage=3`` the data axes (`trainers.core.zero`)."""
        return self.layout.params_at_rest(params, self.layout.base_shardings(params))

    def init_variables(self, first_batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
        """The task's params (placed with their shardings, in the precision's param dtype) and
        model state (replicated), initialised from the seed (`trainers.core.model_state`:
        ``{}`` for a plain task)."""
        example = jax.tree.map(lambda x: x[:1], first_batch)
        rng = jax.random.fold_in(jax.random.key(self.spec.seed), _INIT_STREAM)
        task_init, master = init_fn(self.task), self.precision.master

        def init(rng, example):
            params, model_state = task_init(rng, example)
            return master(params), model_state

        shapes = jax.eval_shape(init, rng, example)
        shardings = (self.param_shardings(shapes[0]), self._replicated)
        with jax.set_mesh(self.mesh):
            return jax.jit(init, out_shardings=shardings)(rng, example)

    def init_params(self, first_batch: dict[str, np.ndarray]) -> Any:
        """Initialises the task's params from the seed, placed with their shardings."""
        return self.init_variables(first_batch)[0]

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Returns the initial `TrainState` for `params` and `model_state` (placed on the
        mesh; None: the empty model state of a plain task)."""
        shardings = self.param_shardings(params)
        params = jax.device_put(params, shardings)
        with jax.set_mesh(self.mesh):  # the axis rules size their state from the mesh
            refuse_nested_cross_shard(jax.eval_shape(self.tx.init, params))
            opt_shardings = self.opt_state_shardings(params)
            opt_state = jax.jit(self.tx.init, out_shardings=opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
        model_state = jax.device_put({} if model_state is None else model_state, self._replicated)
        state = TrainState(step, params, opt_state, model_state)
        if self.periodic_programs is None:
            return state
        with jax.set_mesh(self.mesh):  # the replicas and the outer state
            return self.periodic_programs.replicate(
                state, self.layout, self.param_shardings, self.opt_state_shardings
            )

    def opt_state_shardings(self, params: Any) -> Any:
        """Per-parameter optimizer state (adam's mu, nu) is sharded like its parameter's model
        axes, and with ``zero_stage >= 1`` over the data axes too; everything else (counts,
        hyperparameters) is replicated. See `trainers.core.zero.ZeroLayout.opt_state_shardings`.
        The error-feedback residuals of the axis rules (`xshard.axis_reduce`) are sharded over
        their axis, a row per replica. Call it with the mesh in context (``jax.set_mesh``)."""
        shardings = self.layout.opt_state_shardings(
            self.tx, params, self.layout.base_shardings(params)
        )
        specs = state_partition_specs(jax.eval_shape(self.tx.init, params))
        return jax.tree.map(
            lambda s, spec: s if spec == P() else NamedSharding(self.mesh, spec), shardings, specs
        )

    def state_shardings(self, state: TrainState) -> Any:
        """The shardings every `TrainState` of this run has (what the step keeps)."""
        return jax.tree.map(lambda x: x.sharding, state)

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local NumPy arrays -> global arrays sharded over the data axes."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            local_batch,
        )

    # --------------------------------------------------------------------- step

    def lower(self, level: int, state: TrainState, batch: dict[str, Any]) -> jax.stages.Lowered:
        """Traces and lowers the program of `level` for `state` and batches like `batch`
        (global arrays), without compiling it: its StableHLO (`Lowered.as_text`) says which
        dtypes the step computes in, before the compiler's rewrites."""
        return self._lower(ProgramKey(level), state, batch).lowered

    def _lower(self, key: ProgramKey, state: TrainState, batch: dict[str, Any]) -> Traced:
        """`lower`, with what the tracing recorded (metric keys, per-layer layouts)."""
        shardings = self.state_shardings(state)
        keys: list[tuple[str, ...]] = []
        layouts: list[dict[str, tuple[int, ...]]] = []
        step_fn = (self._warmup_fns if key.warmup else self._step_fns)[key.level]

        def run(state, batch, vote):
            state, metrics, diag = step_fn.fn(state, batch)
            if vote is not None:  # agree_stop: the highest vote of all devices
                metrics = {**metrics, STOP_VOTE_KEY: vote}
            names, values = stack_metrics(metrics)
            keys.append(names)  # at trace time
            # The per-layer statistics travel in the same vector: one transfer to the host.
            shapes, tail = pack_diagnostics(diag)
            layouts.append(shapes)
            return state, jnp.concatenate([values, tail])

        def train_step(state, batch, *votes):
            vote = jnp.max(votes[0]) if votes else None
            if self.periodic is not None:  # every replica alone: a row of metrics each
                return self.periodic.inner(run, state, batch, vote)
            return run(state, batch, vote)

        jitted = jax.jit(
            train_step,
            in_shardings=(shardings, self.batch_sharding)
            + ((self._vote_sharding,) if self.agree_stop else ()),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        try:
            with jax.set_mesh(self.mesh):
                lowered = jitted.lower(state, batch, *self._votes(0))
        except PerShardGradientsRequired as e:
            raise ConfigError(
                f"trainer.grad_impl={self.spec.grad_impl!r} computes no per-shard gradients, "
                f"but the optimizer needs them: {e} Use trainer.grad_impl=manual, or a reduction "
                "without per-shard clipping or weights (reduction.clip_per_shard=null)."
            ) from None
        return Traced(lowered, keys[0], layouts[0], frozenset(step_fn.stats_keys))

    def _compile(
        self, keys: Sequence[ProgramKey], state: TrainState, batch: dict[str, jax.Array]
    ) -> None:
        """Compiles the programs of `keys` for `state` and batches like `batch` (global)."""
        seconds = self.programs.compile(
            keys, lambda key: self._lower(key, state, batch), tuple(leaf_names(state.params))
        )
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        self._report_compile = True

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The compiled step of the lowest level compiled so far (plain steps, the most
        frequent: for HLO, cost and memory analysis); None before the first compilation."""
        return next(iter(self.programs.by_level().values()), None)

    def executable_for(self, level: int, warmup: bool = False) -> jax.stages.Compiled | None:
        """The compiled step that runs (warm-up) steps of `level` (None: not compiled yet)."""
        return self.programs.get(ProgramKey(level, warmup))

    def compile_levels(
        self, state: TrainState, batch: dict[str, Any], levels: Iterable[int]
    ) -> None:
        """Compiles, ahead of time, the programs that run steps of `levels` (those not
        compiled yet), for `state` and batches like `batch` (host-local or global)."""
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        missing = [ProgramKey(lv) for lv in sorted(set(levels))]
        missing = [key for key in missing if self.programs.get(key) is None]
        if missing:
            self._compile(missing, state, batch)

    def executables(self) -> dict[int, jax.stages.Compiled]:
        """Every compiled step so far, by the level it serves, lowest first."""
        return self.programs.by_level()

    def step(
        self,
        state: TrainState,
        batch: dict[str, Any],
        *,
        with_stats: bool = True,
        layer_stats: bool = False,
        histograms: bool = False,
        stop_vote: int = 0,
        warmup: bool = False,
    ) -> tuple[TrainState, StepMetrics]:
        """One update on `batch` (host-local NumPy or global arrays). Donates `state`.

        The step is compiled ahead of time on first use (the program of each level on the
        first step that needs it); later calls reuse it (a batch of another shape is an
        error, never a silent recompilation). The metrics are a
        mapping of floats, fetched from the device on first read.

        Args:
          state: the state to update (donated).
          batch: the step's batch.
          with_stats: compute the update/param norms, the reduced gradient's norm and the
            per-shard statistics (about one kernel per parameter each); without them the
            metrics leave them out.
          layer_stats: also the per-layer norms of the applied gradient and of the new params
            (`StepMetrics.diagnostics`); implies `with_stats`.
          histograms: also gradient histograms per layer; implies `layer_stats`.
          stop_vote: with `agree_stop`, this process's `StopVote.encode`, reduced over all
            processes into the hidden metric `STOP_VOTE_KEY`.
          warmup: run a warm-up step of the periodic axis (its own programs: the gradient
            reduced over that axis too, as `reduction=mean` would); `fit` passes it for
            steps 1 to ``warmup_steps`` (`Periodic.in_warmup`).

        Returns:
          (the new state, its `StepMetrics`).
        """
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        level = (
            HISTOGRAMS if histograms else LAYERS if layer_stats else STATS if with_stats else PLAIN
        )
        if warmup and not self._warmup_fns:
            raise ValueError("warmup=True needs a periodic axis with warmup_steps > 0.")
        key = ProgramKey(level, warmup)
        if self.programs.get(key) is None:
            self._compile([key], state, batch)
        executable = self.programs.get(key)
        assert executable is not None
        state, values = executable(state, batch, *self._votes(stop_vote))
        return state, self.programs.metrics(level, values)

    def sync(
        self, state: TrainState, step: int, metrics: StepMetrics
    ) -> tuple[TrainState, StepMetrics]:
        """After update `step`: the periodic axis's program due, if any
        (`trainers.core.periodic_programs`): the switch from the warm-up after step
        ``warmup_steps``, or the sync of a fragment (`xshard.periodic.due_fragment`), whose
        statistics join the step's metrics; else `state` and `metrics` as they are. Donates
        `state` when a program runs. Each program is compiled when first needed.
        """
        if self.periodic_programs is None:
            return state, metrics
        done = self.periodic_programs.after_step(state, step, metrics, self.state_shardings)
        if done.compile_seconds:
            self.compile_seconds = (self.compile_seconds or 0.0) + done.compile_seconds
            self._report_compile = True
        return done.state, done.metrics

    def sync_executable(self, fragment: int = 0) -> jax.stages.Compiled | None:
        """The compiled sync program of `fragment` (None: not compiled yet, or no periodic
        axis)."""
        programs = self.periodic_programs
        return None if programs is None else programs.sync_executable(fragment)

    def _votes(self, vote: int) -> tuple[jax.Array, ...]:
        """The step's vote input: this process's `vote` on each of its devices (cached); none
        without `agree_stop`."""
        if not self.agree_stop:
            return ()
        if vote not in self._vote_arrays:
            self._vote_arrays[vote] = jax.make_array_from_callback(
                (self.mesh.size,), self._vote_sharding, lambda _: np.full((1,), vote, np.int32)
            )
        return (self._vote_arrays[vote],)

    # --------------------------------------------------------------------- loop

    def fit(
        self,
        state: TrainState,
        batches: Iterable[dict[str, np.ndarray]],
        *,
        num_steps: int,
        hooks: Sequence[Hook] = (),
        layer_stats_every: int = 0,
        histogram_every: int = 0,
        stats_every: int = 1,
        should_stop=lambda: False,
    ) -> tuple[TrainState, str]:
        """Runs until `state.step == num_steps`, the data ends, or a stop is requested.

        Args:
          state: the state to start from (its `step` says where; batches must start there).
          batches: host-local batches for steps state.step, state.step + 1, ...
          num_steps: the total number of updates of the run (not the number left).
          hooks: receive each step's metrics one step late, diagnostics, and the end.
          layer_stats_every / histogram_every: period in steps (0 = never) of the per-layer
            norms and gradient histograms, computed inside those steps from the gradient they
            apply and delivered to `Hook.on_diagnostics` right after the step's metrics.
          stats_every: compute the update/param norms and per-shard statistics on every
            `stats_every`-th step and the last one (0 = only the last); the loss, the reduced
            gradient's norm and the skip counters come every step.
          should_stop: polled before the first step and after every step, with the hooks'
            `wants_stop`; True ends the run cleanly ("stopped"): the current step's state
            goes to `on_state`, then every hook sees `on_end`. Before the first step nothing
            is trained. With `agree_stop` (several processes), `should_stop` and `wants_stop`
            are this process's vote, cast into each step; a vote at step k ends the run after
            step k + 1 on every process (`agreed_stop` says whose vote it was), and nothing is
            checked before the first step (the caller agrees on that).

        Returns:
          (final state, reason the loop ended).

        Raises:
          Whatever a hook or the step raised; every hook's `on_end` ran first. An error in an
          `on_end` is raised after all of them ran (the first one; later ones are logged).
        """
        periods = {
            "stats_every": stats_every,
            "layer_stats_every": layer_stats_every,
            "histogram_every": histogram_every,
        }
        return FitLoop(self, hooks, num_steps, periods, should_stop, state).run(batches)

    def with_compile_time(self, metrics: StepMetrics) -> StepMetrics:
        """`metrics` with `COMPILE_TIME` (the run's compile seconds so far) if a program was
        compiled since the last call: once per compiling step."""
        if not self._report_compile:
            return metrics
        assert self.compile_seconds is not None  # set by the compilation
        self._report_compile = False
        return metrics.with_host_values(**{COMPILE_TIME: self.compile_seconds})
