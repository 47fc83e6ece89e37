"""The cross-shard optimizer: reduce gradients across data-parallel shards, then update.

`cross_shard` wraps any optax transformation, the way TensorFlow's TPU `CrossShardOptimizer`
wrapped a `tf.train.Optimizer`. It is a composition of small optax transforms, applied in this
order in one update:

1. `xshard.reduce.per_shard_clip` (``clip_per_shard``): `optax.clip_by_global_norm` of each
   shard's local gradient (the reason TF reduced late: one shard's huge gradient must not
   dominate the others);
2. `xshard.reduce.all_reduce`: SUM = ``psum``, MEAN = ``pmean``, or a weighted mean
   (``shard_weight``); see `xshard.reduce` for where the reduction happens;
3. `xshard.guard.summarize_updates` (``track_stats``): norm, max |g| and non-finite count of
   the reduced gradient, kept in the state for logging without a second pass;
4. `xshard.guard.skip_if_nonfinite` (``skip_nonfinite``): after the reduction, so every shard
   takes the same decision;
5. the inner optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax

from xshard.guard import (
    SkipIfNonFiniteState,
    apply_always,
    empty_summary,
    skip_if_nonfinite,
    summarize_updates,
)
from xshard.reduce import AxisNames, Reduction, all_reduce, axis_tuple, per_shard_clip
from xshard.stats import GradSummary, count_nonfinite


@dataclasses.dataclass(frozen=True)
class CrossShardSpec:
    """The settings of a `cross_shard` optimizer, for code that runs it (the trainer)."""

    reduction: Reduction
    axis_name: tuple[str, ...]
    clip_per_shard: float | None
    comm_dtype: Any
    skip_nonfinite: bool
    track_stats: bool


def cross_shard_spec(tx: optax.GradientTransformation) -> CrossShardSpec | None:
    """The `CrossShardSpec` of `tx` if it was made by `cross_shard` (not wrapped), else None."""
    return getattr(tx.update, "cross_shard_spec", None)


class CrossShardState(NamedTuple):
    """State of `cross_shard`: the reduced gradient's summary and the guarded inner state."""

    reduced: GradSummary  # norm, max |g| and non-finite count of the last reduced gradient
    guard: SkipIfNonFiniteState  # skip counters and the inner optimizer's state

    @property
    def inner_state(self) -> optax.OptState:
        """The inner optimizer's state."""
        return self.guard.inner_state

    @property
    def skipped_steps(self) -> jax.Array:
        """int32: steps skipped because the reduced gradient was not finite."""
        return self.guard.total_notfinite

    @property
    def consecutive_skipped(self) -> jax.Array:
        """int32: skipped steps in a row, reset by a finite step."""
        return self.guard.notfinite_count


def cross_shard(
    inner: optax.GradientTransformation,
    reduction: Reduction | str = Reduction.MEAN,
    *,
    axis_name: AxisNames = "data",
    clip_per_shard: float | None = None,
    comm_dtype: Any = None,
    skip_nonfinite: bool = False,
    num_shards: int | None = None,
    track_stats: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that gradients are reduced across data-parallel shards first.

    Args:
      inner: any optax transformation (extra arguments are forwarded to it).
      reduction: `Reduction.SUM`/`Reduction.MEAN` or "sum"/"mean" in any case.
      axis_name: the mesh axis, or tuple of axes (e.g. ``("dcn_data", "data")``), to reduce
        over. A factored mesh such as ``(replica, data)`` reduced over ``data`` only gives
        per-group reductions (TF's ``group_assignment``).
      clip_per_shard: clip each shard's local gradient to this global norm before reducing.
      comm_dtype: dtype for the collective (e.g. ``"bfloat16"``); results are cast back.
      skip_nonfinite: if the reduced gradient has a NaN/Inf, leave params and inner state
        unchanged on every shard (zero updates) and count the step in the state.
      num_shards: shard count for SUM outside shard_map when no mesh is in context.
      track_stats: record the norm, max |g| and non-finite count of the reduced gradient in
        ``state.reduced`` (`xshard.stats.GradSummary`), for logging without a second pass.

    Returns:
      An `optax.GradientTransformationExtraArgs`. Its `update` accepts the extra keyword
      ``shard_weight`` (a scalar per shard) for a weighted reduction, and ``with_stats`` (a
      bool, may be traced): when false, `track_stats` records only max |g| and the
      non-finite count (the norm is NaN), saving a reduction per leaf on steps that log
      nothing. Every other extra argument is forwarded to `inner`.

    Raises:
      ValueError: at construction for an unknown reduction or bad clip value; at update time
        (`DoubleReductionError`) when gradients are already reduced over the axis.
    """
    clip = None if clip_per_shard is None else per_shard_clip(clip_per_shard, axis_name)
    reduce = all_reduce(
        reduction, axis_name=axis_name, comm_dtype=comm_dtype, num_shards=num_shards
    )
    summary = summarize_updates()
    guard = (skip_if_nonfinite if skip_nonfinite else apply_always)(inner)
    empty = optax.EmptyState()

    def init_fn(params):
        return CrossShardState(empty_summary(), guard.init(params))

    def update_fn(updates, state, params=None, *, shard_weight=None, with_stats=None, **extra_args):
        if clip is not None:
            updates, _ = clip.update(updates, empty, params)
        updates, _ = reduce.update(updates, empty, params, shard_weight=shard_weight)
        if track_stats:
            _, reduced = summary.update(updates, state.reduced, with_stats=with_stats)
        elif skip_nonfinite:
            reduced = state.reduced._replace(nonfinite=count_nonfinite(updates))
        else:
            reduced = state.reduced
        updates, guarded = guard.update(
            updates, state.guard, params, nonfinite=reduced.nonfinite, **extra_args
        )
        return updates, CrossShardState(reduced, guarded)

    update_fn.cross_shard_spec = CrossShardSpec(  # type: ignore[attr-defined]
        Reduction.parse(reduction),
        axis_tuple(axis_name),
        clip_per_shard,
        comm_dtype,
        skip_nonfinite,
        track_stats,
    )
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
