"""The generic pjit trainer: `init` / `step` / `fit`, over any task and any cross-shard optimizer.

Read top to bottom: placement of params and batches on the mesh, the compiled step, then the
loop. The loop keeps at most two steps in flight: it dispatches step k, then waits for the
metrics of step k-1. That bounds the work queued on the devices (XLA:CPU collectives deadlock
with dozens of steps in flight, see docs/development.md), gives lag-one logging without stalls, and
lets every step's loss be checked on the host.

A stop request (a signal, a hook's `wants_stop`) is local to one process. With several
processes each one casts a vote into the step it dispatches; the step reduces the votes over
all devices and returns the result with its metrics (`STOP_VOTE_KEY`), which the loop fetches
anyway. Every process so learns of a stop voted at step k from the same metrics and ends after
step k + 1: no host synchronisation beyond the existing metrics fetch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.hook import Hook, StopTraining, end_hooks
from trainers.core.metrics import COMPILE_TIME, StepMetrics, pack_diagnostics, stack_metrics
from trainers.core.model_state import init_fn
from trainers.core.periodic import BYTES_TAG, Periodic
from trainers.core.precision import Precision
from trainers.core.step import (
    HISTOGRAMS,
    LAYERS,
    LEVELS,
    PLAIN,
    STATS,
    StepSpec,
    TrainState,
    make_train_step,
)
from trainers.core.step_levels import step_level
from trainers.core.stop_vote import STOP_VOTE_KEY, StopVote
from trainers.core.zero import zero_layout
from xshard.axis_reduce import state_partition_specs
from xshard.axis_rules import AxisRule
from xshard.errors import ConfigError
from xshard.layer_stats import leaf_names
from xshard.mesh import check_batch_divisible
from xshard.optimizer import CrossShardTransformation, cross_shard
from xshard.periodic import due_fragment
from xshard.reduce import PerShardGradientsRequired
from xshard.reduction_mode import Reduction
from xshard.slots import has_cross_shard_state

__all__ = ["Hook", "StopTraining", "StopVote", "Trainer"]

logger = logging.getLogger(__name__)


class _Traced(NamedTuple):
    """A lowered step program and what its tracing recorded."""

    lowered: jax.stages.Lowered
    keys: tuple[str, ...]  # the metric names, in the order of the metrics vector
    layouts: dict[str, tuple[int, ...]]  # the per-layer statistics' shapes after them
    stats_keys: frozenset[str]  # the metrics only statistics steps compute


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
        per_shard = check_batch_divisible(global_batch_size, mesh, data_axes)
        n = global_batch_size // per_shard
        if microbatches < 1 or per_shard % microbatches:
            raise ConfigError(
                f"trainer.microbatches={microbatches} must be >= 1 and divide the per-shard "
                f"batch {per_shard} (trainer.batch_size={global_batch_size} over {n} data "
                "shards)."
            )
        replicas = 1 if self.periodic is None else self.periodic.replicas
        # The rules are read once the params exist (a Flax task's come from its model).
        self.layout = zero_layout(zero_stage, mesh, inner_axes, lambda: task.sharding_rules)
        ruled = [axis for axis, _ in self.tx.spec.axes.rules]
        if ruled and self.layout.stage > 0:
            raise ConfigError(
                f"reduction.axes.{ruled[0]} reduces every step by its own rule, which runs with "
                f"sharding.zero_stage=0 only (got {self.layout.stage}): its error-feedback "
                "state is per replica of the axis, not sliced over the data axes."
            )
        self.spec = StepSpec(
            data_axes=inner_axes,
            num_data_shards=n // replicas,
            global_batch_size=global_batch_size // replicas,
            microbatches=microbatches,
            grad_impl=grad_impl,
            seed=seed,
            replica_axis=None if self.periodic is None else self.periodic.axis,
        )
        self.batch_sharding = NamedSharding(mesh, P(data_axes))
        # A replica's step sees the mesh with the periodic axis manual.
        step_mesh = mesh if self.periodic is None else self.periodic.replica_mesh()
        step_layout = zero_layout(zero_stage, step_mesh, inner_axes, lambda: task.sharding_rules)
        # A step function per level. Validates grad_impl now (ConfigError), not at the first
        # step.
        self._step_fns = {
            lv: make_train_step(
                task, self.tx, step_mesh, self.spec, lv, step_layout, self.precision
            )
            for lv in LEVELS
        }
        # A periodic axis's warm-up steps: the same step reducing over that axis too.
        self._warmup_fns = {}
        if self.periodic is not None and self.periodic.rule.warmup_steps:
            warm_tx = self.periodic.warmup_tx(self.tx, grad_impl, self.layout.stage)
            self._warmup_fns = {
                lv: make_train_step(
                    task, warm_tx, step_mesh, self.spec, lv, step_layout, self.precision
                )
                for lv in LEVELS
            }
        self._groups: tuple[tuple[int, ...], ...] = ()
        self._syncs: dict[int, jax.stages.Compiled] = {}
        self._start: jax.stages.Compiled | None = None
        self._bytes_per_step = 0.0
        self._executables: dict[int, jax.stages.Compiled] = {}
        self._warmup_executables: dict[int, jax.stages.Compiled] = {}
        # Per level: the shapes of the per-layer statistics after its metrics.
        self._diag_layouts: dict[int, dict[str, tuple[int, ...]]] = {}
        self._metric_keys: tuple[str, ...] = ()
        self._stats_keys: frozenset[str] = frozenset()
        self._leaf_names: tuple[str, ...] = ()
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
        if self.periodic is None:
            return TrainState(step, params, opt_state, model_state)
        return self._replicate(TrainState(step, params, opt_state, model_state))

    def _replicate(self, state: TrainState) -> TrainState:
        """A periodic run's state from one replica's: the replicas (a leading dimension over
        the periodic axis) and the outer state (`trainers.core.periodic`)."""
        periodic = self.periodic
        assert periodic is not None
        if jax.tree.leaves(state.model_state):
            raise ConfigError(
                f"reduction.axes.{periodic.axis}: a periodic axis needs a task without model "
                "state (BatchNorm statistics, RNG counters); this task has some."
            )
        layout = self.layout
        base = layout.base_shardings(state.params)
        outer_shardings = layout.sharded(state.params, base) if layout.stage >= 1 else base
        try:
            self._groups = periodic.groups(state.params)
        except ValueError as e:
            raise ConfigError(
                f"reduction.axes.{periodic.axis}.fragments={periodic.rule.fragments}: {e}"
            ) from None
        with jax.set_mesh(self.mesh):
            outer = periodic.init_outer(
                state.params, outer_shardings, base, layout.opt_state_shardings
            )
            params = periodic.stack(state.params, self.param_shardings(state.params))
            opt_state = periodic.stack(state.opt_state, self.opt_state_shardings(state.params))
        self._bytes_per_step = periodic.bytes_per_step(state.params)
        return TrainState(state.step, params, opt_state, state.model_state, outer)

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
        return self._lower(level, state, batch).lowered

    def _lower(
        self, level: int, state: TrainState, batch: dict[str, Any], warmup: bool = False
    ) -> _Traced:
        """`lower`, with what the tracing recorded (metric keys, per-layer layouts)."""
        shardings = self.state_shardings(state)
        keys: list[tuple[str, ...]] = []
        layouts: list[dict[str, tuple[int, ...]]] = []
        step_fn = (self._warmup_fns if warmup else self._step_fns)[level]

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
        return _Traced(lowered, keys[0], layouts[0], frozenset(step_fn.stats_keys))

    def _compile_all(
        self,
        levels: Sequence[int],
        state: TrainState,
        batch: dict[str, jax.Array],
        warmup: bool = False,
    ) -> None:
        """Lowers the programs of `levels` one after another (tracing holds the GIL), then
        compiles them concurrently, one thread each (XLA compiles without it)."""
        start = time.perf_counter()
        traced = {level: self._lower(level, state, batch, warmup) for level in levels}
        if len(traced) == 1:
            compiled = {level: t.lowered.compile() for level, t in traced.items()}
        else:
            with ThreadPoolExecutor(len(traced), thread_name_prefix="xshard-compile") as pool:
                futures = {lv: pool.submit(t.lowered.compile) for lv, t in traced.items()}
                compiled = {level: future.result() for level, future in futures.items()}
        seconds = time.perf_counter() - start
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        for level, t in traced.items():
            if self._metric_keys and t.keys != self._metric_keys:  # one metric layout for all
                raise AssertionError(f"metric keys differ between executables: {t.keys}")
            self._metric_keys = t.keys
            self._diag_layouts[level] = t.layouts
            self._stats_keys = t.stats_keys
            (self._warmup_executables if warmup else self._executables)[level] = compiled[level]
        self._leaf_names = tuple(leaf_names(state.params))
        self._report_compile = True
        logger.info(
            "Compiled the train step for level%s %s in %.2f s.",
            "s" if len(traced) > 1 else "",
            ", ".join(map(str, traced)),
            seconds,
        )

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The compiled step of the lowest level compiled so far (plain steps, the most
        frequent: for HLO, cost and memory analysis); None before the first compilation."""
        return next((self._executables[lv] for lv in LEVELS if lv in self._executables), None)

    def executable_for(self, level: int) -> jax.stages.Compiled | None:
        """The compiled step that runs steps of `level` (None: not compiled yet)."""
        return self._executables.get(level)

    def compile_levels(
        self, state: TrainState, batch: dict[str, Any], levels: Iterable[int]
    ) -> None:
        """Compiles, ahead of time, the programs that run steps of `levels` (those not
        compiled yet), for `state` and batches like `batch` (host-local or global)."""
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        missing = [level for level in sorted(set(levels)) if level not in self._executables]
        if missing:
            self._compile_all(missing, state, batch)

    def executables(self) -> dict[int, jax.stages.Compiled]:
        """Every compiled step so far, by the level it serves, lowest first."""
        return {lv: self._executables[lv] for lv in LEVELS if lv in self._executables}

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
        executables = self._warmup_executables if warmup else self._executables
        if level not in executables:
            self._compile_all([level], state, batch, warmup)
        executable = executables[level]
        state, values = executable(state, batch, *self._votes(stop_vote))
        hidden = (self._stats_keys if level == PLAIN else frozenset()) | {STOP_VOTE_KEY}
        return state, StepMetrics(
            self._metric_keys,
            values,
            hidden=hidden,
            diag=self._diag_layouts[level] if level >= LAYERS else None,
            diag_names=self._leaf_names,
            histograms=level == HISTOGRAMS,
        )

    def sync(
        self, state: TrainState, step: int, metrics: StepMetrics
    ) -> tuple[TrainState, StepMetrics]:
        """After update `step`: the periodic axis's sync, if one of its fragments is due
        (`xshard.periodic.due_fragment`), else `state` and `metrics` as they are. Donates
        `state` when it syncs; the sync's statistics join the step's metrics.

        Each fragment's sync program is compiled on its first use.
        """
        periodic = self.periodic
        if periodic is None:
            return state, metrics
        if step == periodic.rule.warmup_steps:  # the switch to local steps
            if self._start is None:
                shardings = self.state_shardings(state)
                start = time.perf_counter()
                with jax.set_mesh(self.mesh):
                    self._start = (
                        jax.jit(
                            lambda s: periodic.start(s, self._groups),
                            in_shardings=(shardings,),
                            out_shardings=shardings,
                            donate_argnums=(0,),
                        )
                        .lower(state)
                        .compile()
                    )
                self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - start
                self._report_compile = True
            return self._start(state), metrics
        fragment = due_fragment(step, periodic.rule)
        if fragment is None:
            return state, metrics
        if fragment not in self._syncs:
            shardings = self.state_shardings(state)
            start = time.perf_counter()
            with jax.set_mesh(self.mesh):
                self._syncs[fragment] = (
                    jax.jit(
                        lambda s: periodic.sync(s, fragment, self._groups),
                        in_shardings=(shardings,),
                        out_shardings=(shardings, self._replicated),
                        donate_argnums=(0,),
                    )
                    .lower(state)
                    .compile()
                )
            self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - start
            self._report_compile = True
        state, values = self._syncs[fragment](state)
        bytes_tag = BYTES_TAG.format(axis=periodic.axis)
        return state, metrics.with_device_values(periodic.sync_keys(), values).with_host_values(
            **{bytes_tag: self._bytes_per_step}
        )

    def sync_executable(self, fragment: int = 0) -> jax.stages.Compiled | None:
        """The compiled sync program of `fragment` (None: not compiled yet, or no periodic
        axis)."""
        return self._syncs.get(fragment)

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
        step = int(jax.device_get(state.step))
        periods = {
            "stats_every": stats_every,
            "layer_stats_every": layer_stats_every,
            "histogram_every": histogram_every,
        }
        pending: tuple[int, Any] | None = None
        reason = "done"
        batch_iter: Iterator = iter(batches)
        agree = self.agree_stop
        self.agreed_stop = None
        me = jax.process_index()

        def stop_requested() -> bool:
            return bool(should_stop()) or any(h.wants_stop() for h in hooks)

        def vote() -> int:
            hook = any(h.wants_stop() for h in hooks)
            return StopVote.encode(me, bool(should_stop()), hook)

        def emit(pending: tuple[int, Any]) -> None:
            self._emit(pending, hooks)
            done, metrics = pending
            if agree and self.agreed_stop is None:
                self.agreed_stop = StopVote.decode(done, metrics.device_value(STOP_VOTE_KEY))

        try:
            if not agree and stop_requested():  # e.g. a signal during start-up: train nothing
                reason = "stopped"
            while reason == "done" and step < num_steps:
                try:
                    local = next(batch_iter)
                except StopIteration:
                    reason = "data_exhausted"
                    break
                step += 1
                level = step_level(step, num_steps, **periods)
                state, metrics = self.step(
                    state,
                    local,
                    with_stats=level >= STATS,
                    layer_stats=level >= LAYERS,
                    histograms=level >= HISTOGRAMS,
                    stop_vote=vote() if agree else 0,
                    warmup=self.periodic is not None and self.periodic.in_warmup(step),
                )
                state, metrics = self.sync(state, step, metrics)
                if self._report_compile:
                    assert self.compile_seconds is not None  # set by the compilation
                    metrics = metrics.with_host_values(**{COMPILE_TIME: self.compile_seconds})
                    self._report_compile = False
                if pending is not None:  # waits for step - 1 only: two steps in flight at most
                    emit(pending)
                pending = (step, metrics)
                if agree:  # a vote cast at step k - 1 is known now on every process
                    stop = self.agreed_stop is not None and step > self.agreed_stop.step
                else:
                    stop = stop_requested()
                if stop or any(h.wants_state(step) for h in hooks):
                    emit(pending)  # the state's own metrics come first
                    pending = None
                    for h in hooks:
                        h.on_state(step, state)
                if stop:
                    reason = "stopped"
                    break
            if pending is not None:
                emit(pending)
        except StopTraining as stop_request:
            reason = str(stop_request) or "stopped"
        except BaseException:
            end_hooks(hooks, step, state, "error")
            raise
        end_hooks(hooks, int(jax.device_get(state.step)), state, reason)
        return state, reason

    @staticmethod
    def _emit(pending: tuple[int, Any], hooks: Sequence[Hook]) -> None:
        step, metrics = pending
        host = metrics.host_values()  # waits for this step only
        for h in hooks:
            h.on_step(step, host)
        diag = metrics.diagnostics  # None except on the steps that log them
        if diag is not None:
            for h in hooks:
                h.on_diagnostics(step, diag)


def periodic_inner_axes(
    data_axes: tuple[str, ...], periodic: tuple[str, AxisRule] | None
) -> tuple[str, ...]:
    """The data axes a step reduces over: all of them, but a periodic one.

    Raises:
      ConfigError: for a periodic axis that is not a data axis, or the only one.
    """
    if periodic is None:
        return data_axes
    axis, _ = periodic
    inner = tuple(a for a in data_axes if a != axis)
    if axis not in data_axes or not inner:
        raise ConfigError(
            f"reduction.axes.{axis}: a periodic axis must be one of the data axes and not the "
            f"only one (mesh.data_axes={list(data_axes)}): each replica reduces its gradient "
            "over the others every step."
        )
    return inner


def as_cross_shard(
    tx: optax.GradientTransformation,
    reduction: Reduction | str | None,
    data_axes: tuple[str, ...],
) -> CrossShardTransformation:
    """`tx` as the step runs it: a `cross_shard` optimizer as it is, a plain optax one wrapped
    once in ``cross_shard(tx, reduction, axis_name=data_axes)``.

    Args:
      tx: the `Trainer`'s optimizer.
      reduction: the reduction of a plain `tx` (None: MEAN); with a `cross_shard` `tx`,
        None or its own.
      data_axes: the data-parallel mesh axes (the gradients are reduced over them).

    Returns:
      The `CrossShardTransformation`.

    Raises:
      ValueError: for an unknown `reduction`, or one that disagrees with `tx`'s.
    """
    if not isinstance(tx, CrossShardTransformation):
        return cross_shard(
            tx, Reduction.MEAN if reduction is None else reduction, axis_name=data_axes
        )
    if reduction is not None and Reduction.parse(reduction) is not tx.spec.reduction:
        raise ValueError(
            f"reduction={reduction!r} disagrees with the optimizer's "
            f"{tx.spec.reduction.value!r}: a cross_shard optimizer reduces as it was built. "
            "Leave reduction= out, or pass the inner optax optimizer."
        )
    return tx


def refuse_nested_cross_shard(opt_state: Any) -> None:
    """Refuses an optimizer state with a `cross_shard` state inside the outer one's inner
    state: `tx` held a `cross_shard` inside another transformation (an ``optax.chain``), so
    the trainer wrapped it, and every gradient would be reduced twice.

    Args:
      opt_state: the state (or its shapes) of `Trainer.tx`.

    Raises:
      ValueError: naming what to pass instead.
    """
    if has_cross_shard_state(opt_state.inner_state):
        raise ValueError(
            "The optimizer holds an xshard.cross_shard inside another transformation (e.g. "
            "optax.chain(cross_shard(...), ...)), so the Trainer wrapped it in a cross_shard "
            "of its own and would reduce every gradient twice. Put the other transformations "
            "inside the cross_shard, as xshard.build_optimizer does: "
            "cross_shard(optax.chain(inner, ...), ...); or pass the plain optax optimizer, "
            "which the Trainer wraps once (reduction=...)."
        )
