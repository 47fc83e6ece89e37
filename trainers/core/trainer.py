"""The generic pjit trainer: `init` / `step` / `fit`, over any task and any cross-shard optimizer.

`Trainer` sets a run up; the placement of params and batches on the mesh and the initial
state are its base `trainers.core.placement.Placement`, the step programs (compiled per kind of
step by `trainers.core.programs`) and a periodic axis's programs
(`trainers.core.periodic_programs`) its base `trainers.core.dispatch.StepDispatch`. `fit`'s
loop lives in `trainers.core.loop` (two steps in flight at most, lag-one metrics, stops agreed
between processes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.dispatch import StepDispatch
from trainers.core.hook import Hook, StopTraining
from trainers.core.loop import FitLoop
from trainers.core.periodic import Periodic
from trainers.core.periodic_programs import PeriodicPrograms
from trainers.core.precision import Precision
from trainers.core.programs import StepPrograms
from trainers.core.step import make_train_step
from trainers.core.step_levels import LEVELS
from trainers.core.step_tx import as_cross_shard, periodic_inner_axes, step_spec
from trainers.core.step_types import TrainState
from trainers.core.stop_vote import StopVote
from trainers.core.zero import zero_layout
from xshard.config.axes import AxisRule
from xshard.config.reduction import Reduction

__all__ = ["Hook", "StopTraining", "StopVote", "Trainer"]

logger = logging.getLogger(__name__)


class Trainer(StepDispatch):
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

    Each kind of step (plain, statistics, per-layer norms, histograms: the levels of
    `trainers.core.step_levels`) has its own compiled program (docs/benchmarks.md measured the
    alternatives slower). `fit` compiles those its run will meet before the first step,
    concurrently (`compile_run`), so that no statistics step stops the run in its middle to
    compile; ``fit(compile_ahead=False)`` compiles each when a step first needs it instead (a
    faster first step, measured in docs/benchmarks.md). `compile_levels` compiles chosen
    levels ahead of time.

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
        compile_ahead: bool = True,
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
          compile_ahead: compile every step program the run will meet (`compile_run`: the
            levels of its steps from the periods above) before the first step, concurrently,
            with their time reported at that step (`perf/compile_time_s`); False: each when a
            step first needs it.

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
        loop = FitLoop(self, hooks, num_steps, periods, should_stop, state, compile_ahead)
        return loop.run(batches)
