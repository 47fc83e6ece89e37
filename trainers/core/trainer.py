"""The generic pjit trainer: `init` / `step` / `fit`, over any task and any cross-shard optimizer.

`Trainer` sets a run up from its parts: the placement of params and batches on the mesh and
the initial state (`trainers.core.placement.DevicePlacement`), the step programs (compiled per
kind of step, `trainers.core.step.programs.StepPrograms`) and a periodic axis's programs
(`trainers.core.periodic.sync.PeriodicPrograms`). `fit`'s loop lives in `trainers.core.loop`
(two steps in flight at most, lag-one metrics, stops agreed between processes) and returns a
`FitResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from trainers.core.hook import Hook, StopTraining
from trainers.core.loop import FitLoop, FitResult
from trainers.core.metrics import StepMetrics
from trainers.core.periodic.axis import Periodic
from trainers.core.periodic.sync import PeriodicPrograms
from trainers.core.placement import DevicePlacement, StateShapes
from trainers.core.precision import Precision
from trainers.core.step.compiled import ProgramKey
from trainers.core.step.levels import HISTOGRAMS, LAYERS, PLAIN, STATS
from trainers.core.step.optimizer import as_cross_shard
from trainers.core.step.programs import StepFunctionSets, StepPrograms, StepSeat
from trainers.core.step.step_spec import periodic_inner_axes, step_spec
from trainers.core.step.types import TrainState
from trainers.core.step.zero_update import owners
from trainers.core.stop_vote import StopVote
from trainers.core.zero import zero_layout
from trainers.tasks.base import Task
from xshard.config.axes import AxisRule
from xshard.config.reduction import Reduction
from xshard.optim.hyperparams import Hyperparams
from xshard.optim.muon_owners import muon_groups, swap_state

__all__ = ["FitResult", "Hook", "StopTraining", "StopVote", "TrainState", "Trainer"]


class Trainer:
    """Trains `task` with the optimizer `tx` on `mesh`.

    Args:
      task: a `trainers.tasks.base.Task`.
      tx: the optimizer, normally from `xshard.build_optimizer` or `xshard.cross_shard` (a
        `xshard.optim.cross_shard.CrossShardTransformation`, which reduces the gradients and records
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
      hyperparams: the float hyperparameters `tx` and the periodic rule were built on
        (``xshard.build_optimizer_with_rules(cfg).hyperparams``): inputs of the programs, so
        runs that differ only in them share their programs; None: constants of `tx`.
      seat: the run's place in a population (`trainers.core.population.PopulationSeat`): its
        steps (and a periodic axis's syncs) run in one vmapped program with the other
        trials'; None (default): its own.

    Each kind of step (plain, statistics, per-layer norms, histograms: the levels of
    `trainers.core.step.levels`) has its own compiled program (docs/benchmarks.md measured the
    alternatives slower). `fit` compiles those its run will meet before the first step,
    concurrently (`compile_run`), so that no statistics step stops the run in its middle to
    compile; ``fit(compile_ahead=False)`` compiles each when a step first needs it instead (a
    faster first step, measured in docs/benchmarks.md). `compile_levels` compiles chosen
    levels ahead of time.

    Its parts, each built and usable alone:

    Attributes:
      placement: where the params, optimizer state and batches live, and the initial state
        (`trainers.core.placement.DevicePlacement`).
      programs: the step programs, lowered, compiled and dispatched by kind of step
        (`trainers.core.step.programs.StepPrograms`).
      periodic: the periodic axis (`trainers.core.periodic.axis.Periodic`), or None.
      periodic_programs: its sync and warm-up switch programs
        (`trainers.core.periodic.sync.PeriodicPrograms`), or None.
      tx: the optimizer as the step runs it: `tx`, or a plain optax `tx` wrapped once.
      spec: the step's static description (`trainers.core.step.types.StepSpec`).
      layout: the ZeRO layout of the whole mesh (`trainers.core.zero.ZeroLayout`).
      hyperparams: the inputs of the programs (`xshard.optim.hyperparams.Hyperparams`), or None.

    Raises:
      ConfigError: for a batch not divisible over the data shards, a bad microbatch count or
        `grad_impl`.
      ValueError: for a `reduction` that disagrees with a `cross_shard` optimizer's.
    """

    def __init__(
        self,
        task: Task,
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
        hyperparams: Hyperparams | None = None,
        seat: StepSeat | None = None,
    ):
        data_axes = tuple(data_axes)
        self.precision = Precision() if precision is None else precision
        self.task, self.mesh = task, mesh
        self.periodic = None if periodic is None else Periodic(mesh, *periodic)
        # The data axes each replica reduces over every step (all without a periodic axis).
        inner_axes = periodic_inner_axes(data_axes, periodic)
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
        rules: Callable[[], Any] = lambda: task.sharding_rules
        self.layout = zero_layout(zero_stage, mesh, inner_axes, rules)
        self.placement = DevicePlacement(
            task,
            self.tx,
            mesh,
            data_axes=data_axes,
            seed=seed,
            layout=self.layout,
            precision=self.precision,
            hyperparams=hyperparams,
        )
        agree = jax.process_count() > 1 if agree_stop is None else bool(agree_stop)
        self.hyperparams = hyperparams
        # The compile seconds the last fit's steps reported (`perf/compile_time_s`): a later
        # fit reports programs compiled since, in it or before it (`compile_run` ahead).
        self._compile_reported: float | None = None
        self._row_order: Callable[[TrainState], TrainState] | None = None  # `row_order`'s
        self.programs = self._step_programs(zero_stage, inner_axes, rules, agree, seat)
        self.periodic_programs = (
            None if self.periodic is None else PeriodicPrograms(self.periodic, hyperparams, seat)
        )

    def _step_programs(
        self,
        zero_stage: int,
        inner_axes: tuple[str, ...],
        rules: Callable[[], Any],
        agree: bool,
        seat: StepSeat | None = None,
    ) -> StepPrograms:
        """The step programs: a step function per level (validating ``grad_impl`` now, not at
        the first step), and a periodic axis's warm-up ones (the same step reducing over that
        axis too), on `tx` or, traced, on the optimizer `hyperparams` builds. A replica's step
        sees the mesh with the periodic axis manual."""
        periodic, hyperparams = self.periodic, self.hyperparams
        step_mesh = self.mesh if periodic is None else periodic.replica_mesh()
        warmup = None
        if periodic is not None and periodic.rule.warmup_steps:
            warmup = lambda tx: periodic.warmup_tx(tx, self.spec.grad_impl, zero_stage)
        layout = zero_layout(zero_stage, step_mesh, inner_axes, rules)
        fns = StepFunctionSets(self.task, step_mesh, self.spec, layout, self.precision, warmup)
        inputs = None
        if hyperparams is not None:
            tx_of = lambda values: as_cross_shard(hyperparams.build(values).tx, None, inner_axes)
            inputs = fns.inputs(hyperparams.values, tx_of)
        return StepPrograms(
            *fns(self.tx),
            mesh=self.mesh,
            batch_sharding=self.placement.batch_sharding,
            periodic=periodic,
            agree_stop=agree,
            grad_impl=self.spec.grad_impl,
            inputs=inputs,
            seat=seat,
        )

    @property
    def agree_stop(self) -> bool:
        """Whether the processes agree on stops within the steps (their programs take votes)."""
        return self.programs.agree_stop

    @property
    def compile_seconds(self) -> float | None:
        """The seconds spent compiling the step programs and a periodic axis's so far; None
        before the first compilation. In a population: the population's (its steps' and
        syncs'), read when asked."""
        if self.programs.seat is not None:
            return self.programs.seat.compile_seconds
        periodic = self.periodic_programs
        times = [self.programs.compile_seconds]
        times += [] if periodic is None else [periodic.compile_seconds]
        known = [t for t in times if t is not None]
        return sum(known) if known else None

    # ------------------------------------------------------------------ state (placement)

    def init_variables(self, first_batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
        """`DevicePlacement.init_variables`: the params and model state from the seed."""
        return self.placement.init_variables(first_batch)

    def init_params(self, first_batch: dict[str, np.ndarray]) -> Any:
        """Initialises the task's params from the seed, placed with their shardings."""
        return self.placement.init_params(first_batch)

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Returns the initial `TrainState` for `params` and `model_state` (placed on the
        mesh; None: the empty model state of a plain task); with a periodic axis, replicated
        over it with the outer state (`PeriodicPrograms.replicate`)."""
        state = self.placement.init(params, model_state)
        if self.periodic_programs is None:
            return state
        placement = self.placement
        with jax.set_mesh(self.mesh):  # the replicas and the outer state
            return self.periodic_programs.replicate(
                state, self.layout, placement.param_shardings, placement.opt_state_shardings
            )

    def state_shapes(self, batch: Any) -> StateShapes:
        """`DevicePlacement.state_shapes`: the state of `batch` as shapes, nothing allocated."""
        return self.placement.state_shapes(batch)

    def state_shardings(self, state: TrainState) -> Any:
        """The shardings every `TrainState` of this run has (what the step keeps)."""
        return self.placement.state_shardings(state)

    def row_order(self, state: TrainState) -> TrainState:
        """`state` with Muon's momentum swapped between owner order, the order it is kept in
        at rest at ``sharding.zero_stage=3`` (`xshard.optim.muon_owners`), and row order, what
        checkpoints hold (owner order depends on the number of devices, which a restore may
        change, and on the stage): the same swap both ways, so a save takes `state` through
        it and a restore its result. `state` itself where the run keeps row order."""
        n = owners(self.layout, self.periodic is not None)
        if not muon_groups(state.opt_state, n):
            return state
        if self._row_order is None:  # shardings kept: the steps' programs take the result
            shardings = self.state_shardings(state)
            swap = lambda s: s._replace(opt_state=swap_state(s.opt_state, n))
            self._row_order = jax.jit(swap, out_shardings=shardings)
        return self._row_order(state)

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local NumPy arrays -> global arrays sharded over the data axes."""
        return self.placement.global_batch(local_batch)

    # ------------------------------------------------------------------ programs

    def lower(self, level: int, state: TrainState, batch: dict[str, Any]) -> jax.stages.Lowered:
        """Traces and lowers the program of `level` for `state` and batches like `batch`
        (global arrays), without compiling it: its StableHLO (`Lowered.as_text`) says which
        dtypes the step computes in, before the compiler's rewrites."""
        return self.programs.lower(ProgramKey(level), state, batch).lowered

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The compiled step of the lowest level compiled so far (plain steps, the most
        frequent: for HLO, cost and memory analysis); None before the first compilation."""
        return next(iter(self.programs.compiled.by_level().values()), None)

    def executable_for(self, level: int, warmup: bool = False) -> jax.stages.Compiled | None:
        """The compiled step that runs (warm-up) steps of `level` (None: not compiled yet)."""
        return self.programs.compiled.get(ProgramKey(level, warmup))

    def executables(self) -> dict[int, jax.stages.Compiled]:
        """Every compiled step so far, by the level it serves, lowest first."""
        return self.programs.compiled.by_level()

    def compile_levels(
        self, state: TrainState, batch: dict[str, Any], levels: Iterable[int]
    ) -> None:
        """Compiles, ahead of time, the programs that run steps of `levels` (those not
        compiled yet), for `state` and batches like `batch` (host-local or global)."""
        keys = [ProgramKey(lv) for lv in levels]
        self.programs.compile_missing(keys, state, self.placement.as_global(batch))

    def compile_run(
        self,
        state: TrainState,
        batch: dict[str, Any],
        first: int,
        num_steps: int,
        periods: dict[str, int],
    ) -> None:
        """Compiles, concurrently, the step programs that steps `first` .. `num_steps` will run
        (`StepPrograms.compile_run`: the levels of `step_level` from the `periods`, the
        periodic axis's warm-up ones for its warm-up steps), those not compiled yet: no
        statistics step compiles in the middle of the run. The seconds join
        `compile_seconds`."""
        self.programs.compile_run(state, self.placement.as_global(batch), first, num_steps, periods)

    def sync_executable(self, fragment: int = 0) -> jax.stages.Compiled | None:
        """The compiled sync program of `fragment` (None: not compiled yet, or no periodic
        axis)."""
        programs = self.periodic_programs
        return None if programs is None else programs.sync_executable(fragment)

    # ------------------------------------------------------------------ steps

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

        Raises:
          ValueError: for `warmup` without a periodic axis with ``warmup_steps``.
        """
        level = (
            HISTOGRAMS if histograms else LAYERS if layer_stats else STATS if with_stats else PLAIN
        )
        key = ProgramKey(level, warmup)
        return self.programs.run(key, state, self.placement.as_global(batch), stop_vote)

    def sync(
        self, state: TrainState, step: int, metrics: StepMetrics
    ) -> tuple[TrainState, StepMetrics]:
        """After update `step`: the periodic axis's program due, if any
        (`trainers.core.periodic.sync`): the switch from the warm-up after step
        ``warmup_steps``, or the sync of a fragment (`xshard.reduce.periodic.due_fragment`), whose
        statistics join the step's metrics; else `state` and `metrics` as they are. Donates
        `state` when a program runs. Each program is compiled when first needed.
        """
        if self.periodic_programs is None:
            return state, metrics
        done = self.periodic_programs.after_step(state, step, metrics, self.state_shardings)
        return done.state, done.metrics

    # ------------------------------------------------------------------ loop

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
        should_stop: Callable[[], Any] = lambda: False,
        compile_ahead: bool = True,
    ) -> FitResult:
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
            step k + 1 on every process (the result's `agreed_stop` says whose vote it was,
            and every hook's `Hook.on_stop_agreed` hears it as soon as it is known), and
            nothing is checked before the first step (the caller agrees on that).
          compile_ahead: compile every step program the run will meet (`compile_run`: the
            levels of its steps from the periods above) before the first step, concurrently,
            with their time reported at that step (`perf/compile_time_s`, the total so far,
            programs compiled before this fit and not reported by an earlier one included);
            False: each when a step first needs it.

        Returns:
          A `FitResult`: the final state, the reason the loop ended, the agreed stop and the
          compile seconds.

        Raises:
          Whatever a hook or the step raised; every hook's `on_end` ran first. An error in an
          `on_end` is raised after all of them ran (the first one; later ones are logged).
        """
        periods = {
            "stats_every": stats_every,
            "layer_stats_every": layer_stats_every,
            "histogram_every": histogram_every,
        }
        loop = FitLoop(
            self,
            hooks,
            num_steps,
            periods,
            should_stop,
            state,
            compile_ahead,
            reported_compile=self._compile_reported,
        )
        result = loop.run(batches)
        self._compile_reported = loop.reported_compile
        return result
