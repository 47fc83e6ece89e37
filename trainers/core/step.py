"""The train step: gradients (per shard or GSPMD), microbatch accumulation, update, statistics.

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
inside the step; levels the program may take at run time are a traced int under `lax.cond`s,
the others are decided when tracing (see `Trainer`, ``step_executables``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from trainers.config.run import GRAD_IMPLS
from trainers.core.metrics import StepMetrics, stack_metrics, state_metrics
from trainers.core.model_state import LossFn, loss_fn, reduce_over_shards
from trainers.core.zero import ZeroLayout
from trainers.core.zero_step import (
    check_unwrapped,
    constrain_for_update,
    gathered,
    manual_zero_step,
    updated,
    zero_phases,
)
from xshard import Reduction
from xshard.errors import ConfigError
from xshard.optimizer import LocalReduction, cross_shard, cross_shard_phases
from xshard.slots import cross_shard_state, has_cross_shard_state
from xshard.stats import Flag, leaf_sq_norms, when

__all__ = [
    "StepMetrics",
    "StepResult",
    "StepSpec",
    "TrainState",
    "TrainStep",
    "make_train_step",
    "stack_metrics",
]

#: Step levels: what a step computes besides the update (each includes the ones below).
PLAIN, STATS, LAYERS, HISTOGRAMS = 0, 1, 2, 3
LEVELS = (PLAIN, STATS, LAYERS, HISTOGRAMS)


class TrainState(NamedTuple):
    """Everything that changes during training. The RNG is a pure function of (seed, step)."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: optax.OptState
    #: Variables that change but are not trained (BatchNorm statistics, RNG counters):
    #: ``{}`` for a plain task (`trainers.core.model_state`).
    model_state: Any = {}  # noqa: RUF012 - never mutated; a NamedTuple default


class LossAndGrads(NamedTuple):
    """`loss_and_grads`' result: means over the microbatches, and the new model state."""

    loss: jax.Array
    aux: dict[str, jax.Array]
    grads: Any
    model_state: Any


class Updated(NamedTuple):
    """What the update of one step produced (`make_train_step`'s ``update``)."""

    params: Any
    opt_state: optax.OptState
    #: The `cross_shard` state this step recorded (the optimizer's, or the trainer's own).
    cross_shard: Any
    #: Whether `cross_shard` is the optimizer's own state (it counts skipped steps).
    own_optimizer: bool
    #: (update/param norm metrics, the new params' per-leaf norms), NaN off statistics steps.
    measured: Any


class Trained(NamedTuple):
    """The update and its measurements (`make_train_step`'s ``train_and_measure``)."""

    params: Any
    opt_state: optax.OptState
    metrics: dict[str, jax.Array]
    diag: dict[str, Any] | None


class StepResult(NamedTuple):
    """One train step's result."""

    state: TrainState
    #: Scalars; the statistics-only ones are NaN below level 1 (`TrainStep.stats_keys`).
    metrics: dict[str, jax.Array]
    #: Per-layer statistics when a level >= 2 is served, else None.
    diag: dict[str, Any] | None


class TrainStep(NamedTuple):
    """`make_train_step`'s result: the step function and what its metrics mean."""

    fn: Callable[[TrainState, Any, Any], StepResult]
    #: The metrics computed on statistics steps only (NaN below level 1); filled when `fn` is
    #: traced.
    stats_keys: set[str]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of the step (hashable; changing it means a new compilation)."""

    data_axes: tuple[str, ...]
    num_data_shards: int
    global_batch_size: int
    microbatches: int = 1
    grad_impl: str = "manual"
    reduction: Reduction = Reduction.MEAN
    seed: int = 0


def step_rng(seed: int, step: jax.Array) -> jax.Array:
    """The step's RNG key: a pure function of (seed, step), so a resumed run draws the same."""
    return jax.random.fold_in(jax.random.key(seed), step)


def _split_microbatches(batch: Any, k: int) -> Any:
    """(b, ...) -> (k, b // k, ...): microbatch j holds rows j, j + k, j + 2k, ..."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def loss_and_grads(
    loss_fn: LossFn,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
    k: int,
) -> LossAndGrads:
    """Mean loss, mean aux, mean gradient and the new model state over `k` microbatches.

    `loss_fn` is `trainers.core.model_state.loss_fn` of the task. Gradients accumulate in float32
    across a `lax.scan` and are cast back to the params' dtypes once at the end; the model
    state passes through the microbatches in order. Nothing is reduced across shards here.
    """

    def with_state(p, state, b, r):
        loss, aux, state = loss_fn(p, state, b, r)
        return loss, (aux, state)

    grad_fn = jax.value_and_grad(with_state, has_aux=True)
    if k == 1:
        (loss, (aux, model_state)), grads = grad_fn(params, model_state, batch, rng)
        return LossAndGrads(loss, aux, grads, model_state)

    def body(carry, xs):
        acc, state = carry
        mb, i = xs
        (loss, (aux, state)), grads = grad_fn(params, state, mb, jax.random.fold_in(rng, i))
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return (acc, state), (loss, aux)

    acc0 = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    (acc, model_state), (losses, auxes) = jax.lax.scan(
        body, (acc0, model_state), (_split_microbatches(batch, k), jnp.arange(k))
    )
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
    return LossAndGrads(jnp.mean(losses), aux, grads, model_state)


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


def level_flags(level: int | jax.Array, levels: Sequence[int]) -> dict[str, Flag]:
    """The statistics flags for a step of `level`, one of `levels`.

    A flag that holds on every level of `levels` is True, one that holds on none is False
    (both decided when tracing); otherwise it is the traced comparison of `level`:
    ``with_stats`` from level 1, ``layer_norms`` (the gradient's per-leaf norms, a reduction
    per leaf, which statistics steps skip: their global norm and max |g| are one reduction
    each over the packed gradient) from level 2, ``histograms`` at level 3.
    """

    def flag(threshold: int) -> Flag:
        if all(lv >= threshold for lv in levels):
            return True
        if not any(lv >= threshold for lv in levels):
            return False
        return level >= threshold

    return {
        "with_stats": flag(STATS),
        "layer_norms": flag(LAYERS),
        "histograms": flag(HISTOGRAMS),
    }


def make_train_step(
    task: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    spec: StepSpec,
    levels: Sequence[int] = LEVELS,
    layout: ZeroLayout | None = None,
) -> TrainStep:
    """Returns ``step(state, batch, level) -> StepResult``, to be jitted, in a `TrainStep`.

    Args:
      task, tx, mesh, spec: the task, the optimizer (with extra-args support), the mesh and
        the static description of the step.
      levels: the levels this program serves. With several, `level` is a traced int32 and
        what differs between them runs under `lax.cond` (one executable); with one, `level`
        is ignored and the program computes exactly that level.
      layout: with a ZeRO stage >= 1, where the gradient is reduced and the update runs
        (`trainers.core.zero_step`); None or stage 0: everything replicated over the data axes.

    Returns:
      The step. `metrics` is a dict of scalars; those computed on statistics steps only are
      NaN below level 1, and `TrainStep.stats_keys` (filled when the step is traced) names
      them. `diag` (present when a level >= 2 is served) holds the per-layer statistics:
      ``grad_norms`` (the applied gradient's per-leaf norms), ``param_norms`` (the new
      params') and, when level 3 is served, ``grad_hist`` (`xshard.layer_stats.Histograms`).

      A `tx` without a `cross_shard` state (a plain optax optimizer) gets the per-shard
      gradients reduced by the trainer first (``spec.reduction``: MEAN = ``pmean``), with the
      same statistics but no skip counters (it skips nothing).
    """
    if spec.grad_impl not in GRAD_IMPLS:
        raise ConfigError(
            f"trainer.grad_impl={spec.grad_impl!r} is not allowed; choose one of {GRAD_IMPLS}."
        )
    levels = tuple(sorted(set(levels)))
    if not levels or not set(levels) <= set(LEVELS):
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels!r}.")
    axes = spec.data_axes
    per_shard = spec.grad_impl == "manual"
    per_shard_batch = spec.global_batch_size // spec.num_data_shards
    diag_wanted = levels[-1] >= LAYERS
    stats_keys: set[str] = set()
    # The reduction for a plain optax optimizer: cross_shard's own, statistics and all.
    front = cross_shard(optax.identity(), spec.reduction, axis_name=axes)
    task_loss = loss_fn(task)
    zero = layout is not None and layout.stage > 0
    phases = zero_phases(tx, front) if zero else None

    own_phases = cross_shard_phases(tx)

    def measure(new_params, updates, summary=None):
        """What statistics steps measure of the update: `_norm_metrics`."""
        del summary
        return _norm_metrics(new_params, jnp.sqrt(jnp.sum(leaf_sq_norms(updates))))

    def update(params, opt_state, grads, flags) -> Updated:
        """The update; `measure` where ``flags["with_stats"]`` holds, NaN elsewhere."""

        def applied(updates, opt_state, cs, own: bool) -> Updated:
            new_params = optax.apply_updates(params, updates)
            measured = when(flags["with_stats"], lambda: measure(new_params, updates))
            return Updated(new_params, opt_state, cs, own, measured)

        if isinstance(grads, LocalReduction):  # reduced in the shard_map (ZeRO, manual)
            assert phases is not None  # set with ZeRO
            if phases.own:
                new_params, opt_state, measured = phases.apply(
                    grads, opt_state, params, measure=measure, **flags
                )
                return Updated(new_params, opt_state, cross_shard_state(opt_state), True, measured)
            check_unwrapped(opt_state)
            grads, cs = phases.finish(grads, front.init(params), params, **flags)
            updates, opt_state = tx.update(grads, opt_state, params)
            return applied(updates, opt_state, cs, False)
        if own_phases is not None and has_cross_shard_state(opt_state):
            # The optimizer is cross_shard itself: the update applied in the guard's branch.
            local = own_phases.reduce(grads, params, with_stats=flags["with_stats"])
            new_params, opt_state, measured = own_phases.apply(
                local, opt_state, params, measure=measure, **flags
            )
            return Updated(new_params, opt_state, cross_shard_state(opt_state), True, measured)
        if has_cross_shard_state(opt_state):  # cross_shard inside a chain
            updates, opt_state = tx.update(grads, opt_state, params, **flags)
            return applied(updates, opt_state, cross_shard_state(opt_state), True)
        grads, cs = front.update(grads, front.init(params), params, **flags)
        updates, opt_state = tx.update(grads, opt_state, params)
        return applied(updates, opt_state, cs, False)

    def train_and_measure(params, opt_state, grads, level) -> Trained:
        flags = level_flags(level, levels)
        if zero:  # the update on each device's slice
            assert layout is not None  # zero implies a layout
            params, grads = constrain_for_update(layout, params, grads)
        done = update(params, opt_state, grads, flags)
        new_params = done.params
        if zero:
            assert layout is not None
            new_params = updated(layout, done.params)
        metrics, stats_only = state_metrics(
            done.cross_shard,
            done.opt_state,
            own_optimizer=done.own_optimizer,
            per_shard=per_shard,
            batch_sizes=(per_shard_batch, spec.global_batch_size),
        )
        norms, param_leaf_norms = done.measured
        metrics |= norms
        stats_keys.update(stats_only | set(norms))
        if flags["with_stats"] is False:  # a plain program: no kernel for hidden metrics
            metrics |= {k: jnp.full((), jnp.nan, jnp.float32) for k in stats_only | set(norms)}
        diag = None
        if diag_wanted:
            cs = done.cross_shard
            diag = {"grad_norms": cs.reduced.leaf_norms, "param_norms": param_leaf_norms}
            if flags["histograms"] is not False:
                diag["grad_hist"] = cs.histograms
        return Trained(new_params, done.opt_state, metrics, diag)

    def manual(state: TrainState, batch, level) -> StepResult:
        traced = () if len(levels) == 1 else (level,)  # a single level is static

        def shard_step(params, opt_state, model_state, batch, rng, *traced):
            level = traced[0] if traced else levels[0]
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
            local = jax.lax.pcast(params, axes, to="varying")
            out = loss_and_grads(task_loss, local, model_state, batch, rng, spec.microbatches)
            trained = train_and_measure(params, opt_state, out.grads, level)
            trained.metrics["train/loss"] = jax.lax.pmean(out.loss, axes)
            trained.metrics.update(
                {f"train/{k}": jax.lax.pmean(v, axes) for k, v in out.aux.items()}
            )
            return trained, reduce_over_shards(out.model_state, axes)

        trained, model_state = jax.shard_map(
            shard_step,
            mesh=mesh,
            in_specs=(P(), P(), P(), P(axes), P()) + (P(),) * len(traced),
            out_specs=P(),
            axis_names=set(axes),
        )(
            state.params,
            state.opt_state,
            state.model_state,
            batch,
            step_rng(spec.seed, state.step),
            *traced,
        )
        new_state = TrainState(state.step + 1, trained.params, trained.opt_state, model_state)
        return StepResult(new_state, trained.metrics, trained.diag)

    def gspmd(state: TrainState, batch, level) -> StepResult:
        rng = step_rng(spec.seed, state.step)
        params = state.params
        if zero:
            assert layout is not None
            params = gathered(layout, state.params)
        out = loss_and_grads(task_loss, params, state.model_state, batch, rng, spec.microbatches)
        level = level if len(levels) > 1 else levels[0]
        trained = train_and_measure(state.params, state.opt_state, out.grads, level)
        metrics = trained.metrics | {"train/loss": out.loss}
        metrics |= {f"train/{k}": v for k, v in out.aux.items()}
        new_state = TrainState(state.step + 1, trained.params, trained.opt_state, out.model_state)
        return StepResult(new_state, metrics, trained.diag)

    def manual_zero(state: TrainState, batch, level) -> StepResult:
        def shard_grads(params, model_state, batch, rng) -> LossAndGrads:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
            local = jax.lax.pcast(params, axes, to="varying")
            out = loss_and_grads(task_loss, local, model_state, batch, rng, spec.microbatches)
            return out._replace(model_state=reduce_over_shards(out.model_state, axes))

        assert layout is not None and phases is not None  # manual_zero runs with ZeRO only
        reduce = manual_zero_step(
            layout, mesh, axes, levels, phases.reduce, shard_grads, level_flags
        )
        rng = step_rng(spec.seed, state.step)
        reduced = reduce(gathered(layout, state.params), state.model_state, batch, rng, level)
        level = level if len(levels) > 1 else levels[0]
        trained = train_and_measure(state.params, state.opt_state, reduced.local, level)
        new_state = TrainState(
            state.step + 1, trained.params, trained.opt_state, reduced.model_state
        )
        return StepResult(new_state, trained.metrics | reduced.metrics, trained.diag)

    if zero and per_shard:
        return TrainStep(manual_zero, stats_keys)
    return TrainStep(manual if per_shard else gspmd, stats_keys)
