"""The train step: gradients (per shard or GSPMD), update, statistics.

Two ways to get the gradient, one result:

* ``manual`` (default): ``jax.shard_map`` is manual over the data-parallel axes and automatic
  over the model axes. Params are cast to varying, so ``jax.grad`` gives each shard's own
  gradient; the cross-shard optimizer reduces it and records the per-shard statistics.
* ``gspmd``: ``jax.grad`` of the global-mean loss under plain ``jit``; the compiler inserts the
  reduction, and the cross-shard optimizer sees an already reduced gradient (MEAN = identity).

What a step computes besides the update is its *level*: 0 plain (loss, what the optimizer
state records every step), 1 statistics (update/param norms, the reduced gradient's norm,
per-shard statistics), 2 statistics plus the per-layer norms of the applied gradient and of
the params (taken from the same sums of squares as the global norms: returning them is all
level 2 adds), 3 those and gradient histograms. All of it comes from the step's own gradient,
inside the step. A step program serves one level, decided when tracing: the trainer compiles a
program per level its run meets (one program for several levels, the differences under
`lax.cond`, was measured slower on every step: docs/benchmarks.md).

There is one update path: the optimizer is a `cross_shard` (`Trainer` wraps a plain optax
one), whose phases (`xshard.optim.cross_shard.CrossShardPhases`) the step runs: ``reduce`` where the
per-shard gradients are, ``apply`` (the guard, the inner update and its addition to the params,
in one branch) after it.

The step's data (`TrainState`, `StepSpec`, `StepResult`, `TrainStep`) live in
`trainers.core.step.types` and the levels in `trainers.core.step.levels`; the loss and gradient
over microbatches in `trainers.core.step.grads`, the ZeRO variants in
`trainers.core.step.zero_update`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trainers.core.metrics import state_metrics
from trainers.core.model_state import LossFn, loss_fn, reduce_over_shards
from trainers.core.precision import Precision
from trainers.core.step.grads import LossAndGrads, loss_and_grads
from trainers.core.step.levels import (
    LEVELS,
    LevelFlags,
    level_flags,
)
from trainers.core.step.types import StepResult, StepSpec, TrainState, TrainStep, step_rng
from trainers.core.step.zero_update import (
    constrain_for_update,
    gathered,
    manual_zero_step,
    owner_args,
    owner_order,
    owners,
    updated,
    whole_at_rest,
)
from trainers.core.zero import ZeroLayout
from trainers.tasks.base import Task
from xshard.optim.cross_shard import Applied, CrossShardTransformation, LocalReduction
from xshard.optim.muon import whole_updates
from xshard.reduce.per_axis import state_partition_specs
from xshard.stats.tree import leaf_sq_norms


class OptimizerInputs(NamedTuple):
    """The float hyperparameters a step takes as inputs (`xshard.optim.hyperparams`), traced,
    and ``build(values) -> the optimizer`` on them. The step's ``shard_map`` takes `values` as
    arguments and builds the optimizer inside it: a ``shard_map`` nested in another (a
    periodic axis's replicas) cannot close over them."""

    values: Mapping[str, Any]
    build: Callable[[Mapping[str, Any]], CrossShardTransformation]


class Trained(NamedTuple):
    """The update and its measurements (`_StepProgram.train_and_measure`)."""

    params: Any
    opt_state: optax.OptState
    metrics: dict[str, jax.Array]
    diag: dict[str, Any] | None


def _norm_metrics(new_params, update_norm) -> tuple[dict[str, jax.Array], jax.Array]:
    """The update/param norms, and the new params' per-leaf norms (from the same sums)."""
    # Only the new params are read: reading the old ones after the update would make XLA
    # copy the donated params every step.
    leaf_sq = leaf_sq_norms(new_params)
    param_norm = jnp.sqrt(jnp.sum(leaf_sq))
    metrics = {
        "optim/update_norm": update_norm,
        "optim/update_param_ratio": update_norm / jnp.maximum(param_norm, 1e-12),
        "params/global_norm": param_norm,
    }
    return metrics, jnp.sqrt(leaf_sq)


def _measure(new_params: Any, updates: Any, summary: Any) -> tuple[Any, jax.Array]:
    """What statistics steps measure of the update (`xshard.CrossShardPhases.apply`'s
    ``measure``): `_norm_metrics`."""
    del summary
    return _norm_metrics(new_params, jnp.sqrt(jnp.sum(leaf_sq_norms(updates))))


def make_train_step(
    task: Task,
    tx: CrossShardTransformation,
    mesh: Mesh,
    spec: StepSpec,
    level: int,
    layout: ZeroLayout | None = None,
    precision: Precision | None = None,
    inputs: OptimizerInputs | None = None,
) -> TrainStep:
    """Returns ``step(state, batch) -> StepResult`` of one level, to be jitted, in a
    `TrainStep`.

    Args:
      task: the task.
      tx: the optimizer, made by `xshard.cross_shard` (`Trainer` wraps a plain optax one):
        the step runs its phases.
      mesh: the device mesh.
      spec: the static description of the step.
      level: the level the program computes (`LEVELS`).
      layout: with a ZeRO stage >= 1, where the gradient is reduced and the update runs
        (`trainers.core.step.zero_update`); None or stage 0: everything replicated over the
        data axes.
      precision: the dtypes of the params and of the loss's computation
        (`trainers.core.precision`): the task's loss runs on params cast to the compute dtype;
        None: float32 throughout.
      inputs: the traced hyperparameters `tx` was built on, and its builder: the per-shard
        step rebuilds `tx` from them inside its ``shard_map``; None: `tx` as it is.

    Returns:
      The step. `metrics` is a dict of scalars; those computed on statistics steps only are
      NaN below level 1, and `TrainStep.stats_keys` (filled when the step is traced) names
      them. `diag` (from level 2) holds the per-layer statistics: ``grad_norms`` (the applied
      gradient's per-leaf norms), ``param_norms`` (the new params') and, at level 3,
      ``grad_hist`` (`xshard.stats.layers.Histograms`).

    Raises:
      ValueError: for a level that is not one of `LEVELS`.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}.")
    task_loss = (precision or Precision()).loss_fn(loss_fn(task))
    flags = level_flags(level)
    program = _StepProgram(task_loss, tx, mesh, spec, flags, layout, set(), inputs)
    if spec.grad_impl == "gspmd":
        return TrainStep(program.gspmd, program.stats_keys)
    return TrainStep(program.manual_zero if program.zero else program.manual, program.stats_keys)


@dataclasses.dataclass(frozen=True, eq=False)  # as a closure: equal only to itself
class _StepProgram:
    """The train step of one level (`make_train_step`): gradients, update, metrics.

    Attributes:
      task_loss: the task's loss (`trainers.core.model_state.loss_fn`).
      tx: the cross-shard optimizer, run by its phases.
      mesh: the device mesh.
      spec: the static description of the step.
      flags: the level's statistics flags.
      layout: the ZeRO layout, or None.
      stats_keys: the metrics only statistics steps compute, filled when tracing.
      inputs: the hyperparameters `tx` was built on (`OptimizerInputs`), or None.
    """

    task_loss: LossFn
    tx: CrossShardTransformation
    mesh: Mesh
    spec: StepSpec
    flags: LevelFlags
    layout: ZeroLayout | None
    stats_keys: set[str]
    inputs: OptimizerInputs | None = None

    @property
    def zero(self) -> bool:
        """Whether the update runs on slices (a ZeRO stage >= 1)."""
        return self.layout is not None and self.layout.stage > 0

    @property
    def zero_layout(self) -> ZeroLayout:
        """The ZeRO layout (a ZeRO step only)."""
        assert self.layout is not None
        return self.layout

    def update(self, params: Any, opt_state: Any, grads: Any, **extra_args: Any) -> Applied:
        """The optimizer's phases on `grads` (per shard, or already reduced: a
        `LocalReduction` from the ZeRO shard_map); the update applied in the guard's branch,
        with `_measure` there on statistics steps (NaN elsewhere); `extra_args` to the inner
        optimizer (`owner_args`)."""
        phases, flags = self.tx.phases, self.flags
        local = grads
        if not isinstance(grads, LocalReduction):
            local = phases.reduce(grads, params, with_stats=flags.with_stats, comm=opt_state.comm)
        return phases.apply(
            local, opt_state, params, measure=_measure, **flags._asdict(), **extra_args
        )

    @property
    def owners(self) -> int:
        """The devices owning Muon's matrices, over which its momentum is in owner order
        (`trainers.core.step.zero_update.owners`; 0: row order)."""
        return owners(self.layout, self.spec.replica_axis is not None)

    def owner_order(self, opt_state: Any) -> Any:
        """The groups whose gradient this step swaps to owner order before reducing it
        (`owner_order`): not where it measures the gradient per leaf (per-layer norms,
        histograms) or reduces it by per-axis rules (whose codecs scale per leaf)."""
        flags = self.flags
        per_leaf = flags.layer_norms or flags.histograms or bool(self.tx.spec.axes.rules)
        return owner_order(self.layout, opt_state, self.owners, per_leaf)

    def train_and_measure(
        self, params: Any, opt_state: Any, grads: Any, owned_grads: bool = False
    ) -> Trained:
        """The update, and the metrics and per-layer statistics of the step's level;
        `owned_grads`: Muon's gradient came in owner order (`owner_order`)."""
        flags = self.flags
        held = whole_updates(opt_state)
        whole = whole_at_rest(self.zero_layout, held) if self.zero else None
        extra = owner_args(self.layout, held, self.owners, owned_grads)
        if self.zero:  # the update on each device's slice (or whole, where `whole` says)
            params, grads = constrain_for_update(self.zero_layout, params, grads, whole)
        done = self.update(params, opt_state, grads, **extra)
        new_params = updated(self.zero_layout, done.params, whole) if self.zero else done.params
        metrics, stats_only = state_metrics(
            done.state,
            skips=self.tx.spec.skip_nonfinite,
            per_shard=self.spec.grad_impl == "manual",
            batch_sizes=(
                self.spec.global_batch_size // self.spec.num_data_shards,
                self.spec.global_batch_size,
            ),
        )
        norms, param_leaf_norms = done.measured
        metrics |= norms
        self.stats_keys.update(stats_only | set(norms))
        if not flags.with_stats:  # a plain program: no kernel for hidden metrics
            metrics |= {k: jnp.full((), jnp.nan, jnp.float32) for k in stats_only | set(norms)}
        diag = None
        if flags.layer_norms:
            reduced = done.state.reduced
            diag = {"grad_norms": reduced.leaf_norms, "param_norms": param_leaf_norms}
            if flags.histograms:
                diag["grad_hist"] = done.state.histograms
        return Trained(new_params, done.state, metrics, diag)

    def _loss_and_grads(self, params: Any, model_state: Any, batch: Any, rng: jax.Array):
        """Inside the shard_map: this shard's loss and gradient (params cast to varying)."""
        axes = self.spec.data_axes
        replica = self.spec.replica_axis
        shard = jax.lax.axis_index(axes if replica is None else (replica, *axes))
        rng = jax.random.fold_in(rng, shard)
        local = jax.lax.pcast(params, axes, to="varying")
        return loss_and_grads(
            self.task_loss, local, model_state, batch, rng, self.spec.microbatches
        )

    def manual(self, state: TrainState, batch: Any) -> StepResult:
        """``grad_impl=manual``, replicated: the whole step in a shard_map."""
        axes = self.spec.data_axes
        opt_specs = state_partition_specs(state.opt_state)  # P() but for per-replica residuals
        trained, model_state = jax.shard_map(
            self._manual_shard_step,
            mesh=self.mesh,
            in_specs=(P(), opt_specs, P(), P(axes), P(), P()),
            # Specs in place of values: a pytree prefix of the result's structure.
            out_specs=(Trained(P(), opt_specs, P(), P()), P()),  # type: ignore[arg-type]
            axis_names=set(axes),
        )(
            state.params,
            state.opt_state,
            state.model_state,
            batch,
            step_rng(self.spec.seed, state.step),
            {} if self.inputs is None else self.inputs.values,
        )
        new_state = TrainState(state.step + 1, trained.params, trained.opt_state, model_state)
        return StepResult(new_state, trained.metrics, trained.diag)

    def _manual_shard_step(
        self,
        params: Any,
        opt_state: Any,
        model_state: Any,
        batch: Any,
        rng: jax.Array,
        hyperparams: Any,
    ) -> tuple[Trained, Any]:
        axes = self.spec.data_axes
        out = self._loss_and_grads(params, model_state, batch, rng)
        program = self  # the optimizer on this shard_map's own hyperparameters
        if self.inputs is not None:
            program = dataclasses.replace(self, tx=self.inputs.build(hyperparams))
        trained = program.train_and_measure(params, opt_state, out.grads)
        trained.metrics["train/loss"] = jax.lax.pmean(out.loss, axes)
        trained.metrics.update({f"train/{k}": jax.lax.pmean(v, axes) for k, v in out.aux.items()})
        return trained, reduce_over_shards(out.model_state, axes)

    def gspmd(self, state: TrainState, batch: Any) -> StepResult:
        """``grad_impl=gspmd``: the gradient of the global-mean loss under plain jit."""
        rng = step_rng(self.spec.seed, state.step)
        if self.spec.replica_axis is not None:  # each replica its own draws
            rng = jax.random.fold_in(rng, jax.lax.axis_index(self.spec.replica_axis))
        params = gathered(self.zero_layout, state.params) if self.zero else state.params
        out = loss_and_grads(
            self.task_loss, params, state.model_state, batch, rng, self.spec.microbatches
        )
        # Muon's gradient in row order: the compiler reduces it (`owner_order`).
        trained = self.train_and_measure(state.params, state.opt_state, out.grads)
        metrics = trained.metrics | {"train/loss": out.loss}
        metrics |= {f"train/{k}": v for k, v in out.aux.items()}
        new_state = TrainState(state.step + 1, trained.params, trained.opt_state, out.model_state)
        return StepResult(new_state, metrics, trained.diag)

    def manual_zero(self, state: TrainState, batch: Any) -> StepResult:
        """``grad_impl=manual`` with ZeRO: the reduction in a shard_map, the update on the
        slices outside it (`trainers.core.step.zero_update`)."""
        owners = self.owner_order(state.opt_state)
        reduce = manual_zero_step(
            self.zero_layout,
            self.mesh,
            self.spec.data_axes,
            self.flags.with_stats,
            self.tx.phases.reduce,
            self._shard_grads,
            whole=bool(self.tx.spec.axes.rules),
            updated_whole=whole_at_rest(self.zero_layout, whole_updates(state.opt_state)),
            owners=owners,
        )
        rng = step_rng(self.spec.seed, state.step)
        comm = state.opt_state.comm if self.tx.spec.axes.rules else None
        params = gathered(self.zero_layout, state.params)
        reduced = reduce(params, state.model_state, batch, rng, comm)
        trained = self.train_and_measure(state.params, state.opt_state, reduced.local, bool(owners))
        new_state = TrainState(
            state.step + 1, trained.params, trained.opt_state, reduced.model_state
        )
        return StepResult(new_state, trained.metrics | reduced.metrics, trained.diag)

    def _shard_grads(
        self, params: Any, model_state: Any, batch: Any, rng: jax.Array
    ) -> LossAndGrads:
        out = self._loss_and_grads(params, model_state, batch, rng)
        axes = self.spec.data_axes
        return out._replace(model_state=reduce_over_shards(out.model_state, axes))
