"""The cross-shard optimizer: reduce gradients across data-parallel shards, then update.

`cross_shard` wraps any optax transformation, the way TensorFlow's TPU `CrossShardOptimizer`
wrapped a `tf.train.Optimizer`. It is a composition of small optax transforms, applied in this
order in one update:

1. `xshard.reduce.shard_clip.per_shard_clip` (``clip_per_shard``): `optax.clip_by_global_norm` of
   each shard's local gradient (the reason TF reduced late: one shard's huge gradient must not
   dominate the others);
2. `xshard.reduce.gradients.all_reduce`: SUM = ``psum``, MEAN = ``pmean``, or a weighted mean
   (``shard_weight``); see `xshard.reduce` for where the reduction happens. MEAN's division
   is left to the consumers of the sum, where XLA fuses it (`LocalReduction.gradient`). With
   per-axis rules (``axes``, `xshard.reduce.per_axis`) the mode reduces over the axes without a
   rule, then the every-step rule (at most one) over its axis (mean, sum or Adasum, in a
   codec, with error feedback kept in ``state.comm``); a periodic axis takes no part;
3. statistics (``track_stats``), kept in the state for logging without a second pass: the
   norms and non-finite count of the reduced gradient on every update, its max |g| and the
   local gradients' norms and noise-scale terms (`xshard.stats.shards`) on statistics updates
   (``with_stats``), per-leaf norms (``layer_norms``) and histograms on the updates that ask
   for them;
4. the non-finite guard (``skip_nonfinite``): after the reduction, so every shard takes the
   same decision;
5. the inner optimizer.

Steps 3-5 (and, in `CrossShardPhases.apply`, the addition of the updates to the params) run
in one branch of one `lax.cond` (`xshard.guard.update.GuardedUpdate`).

The update's steps run in `xshard.optim.cross_shard_update.CrossShardUpdate`. `cross_shard` returns
a `CrossShardTransformation`: optax's ``(init, update)`` pair, which also
carries its settings (`CrossShardSpec`) and its update in two phases (`CrossShardPhases`); those
types live in `xshard.optim.cross_shard_types`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from xshard.config.axes import AxisRule
from xshard.config.reduction import Reduction
from xshard.guard.update import guarded_update
from xshard.optim.cross_shard_types import (
    Applied,
    CrossShardPhases,
    CrossShardSpec,
    CrossShardState,
    CrossShardTransformation,
    LocalReduction,
)
from xshard.optim.cross_shard_update import CrossShardUpdate
from xshard.reduce.gradients import AllReduce, AxisNames, axis_tuple, per_shard_clip
from xshard.reduce.per_axis import AxisReductions

__all__ = [
    "Applied",
    "CrossShardPhases",
    "CrossShardSpec",
    "CrossShardState",
    "CrossShardTransformation",
    "LocalReduction",
    "cross_shard",
    "over_axes",
]


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
    axes: Mapping[str, AxisRule] | None = None,
) -> CrossShardTransformation:
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
      track_stats: record statistics in the state for logging without a second pass: of the
        reduced gradient its norm, max |g|, non-finite count and per-leaf norms
        (``state.reduced``, `xshard.stats.tree.GradSummary`) and per-leaf histograms
        (``state.histograms``, `xshard.stats.layers.Histograms`); inside shard_map, of the
        local gradients their norms before clipping and the noise-scale terms
        (``state.shards``, `xshard.stats.shards.ShardStats`) and, with `clip_per_shard`, the
        share of shards clipped (``state.clip``).
      axes: per mesh axis of `axis_name`, how it reduces (`xshard.config.axes.AxisRule`;
        None: every axis by `reduction`, as before). The gradient is reduced by `reduction`
        over the axes without a rule, then over the axis with an every-step rule (at most
        one) by its rule (mean, sum, Adasum) and codec, with its error-feedback residual in
        ``state.comm`` (`xshard.reduce.per_axis`); an axis with a periodic rule takes no part
        in the step. Needs per-shard gradients inside shard_map, and the mesh in context at
        ``init`` (``jax.set_mesh``).

    Returns:
      A `CrossShardTransformation`, an `optax.GradientTransformationExtraArgs` whose
      ``spec`` and ``phases`` say how it was built and split its update. Its `update` accepts
      the extra keywords ``shard_weight`` (a scalar per shard) for a weighted reduction, and
      the statistics flags, each None, a Python bool or a traced bool (one executable for
      both values): ``with_stats`` (default: on every update) — when false only the norms
      and the non-finite count of the reduced gradient are recorded (what the guard needs),
      and nothing that needs a collective; ``layer_norms`` (default: with the statistics) —
      the per-leaf norms of the reduced gradient (a reduction per leaf; the global norm and
      max |g| are one reduction each over the packed gradient on CPU); ``histograms``
      (default: never) — per-leaf histograms of the reduced gradient. Statistics not
      computed on an update are NaN. Every other extra argument is forwarded to `inner`.

    Raises:
      ValueError: at construction for an unknown reduction, bad clip value or bad axis rule;
        at update time (`DoubleReductionError`) when gradients are already reduced over the
        axis.
    """
    names = axis_tuple(axis_name)
    rules = AxisReductions.build(axes, names)
    mode = Reduction.parse(reduction)
    spec = CrossShardSpec(
        mode,
        names,
        clip_per_shard,
        comm_dtype,
        skip_nonfinite,
        track_stats,
        num_shards,
        rules,
        inner,
    )
    parts = _update(spec)
    phases = CrossShardPhases(parts.reduce, parts.finish, parts.apply)
    return CrossShardTransformation(parts.init, parts.update, spec, phases)


def _update(spec: CrossShardSpec) -> CrossShardUpdate:
    """The update of the `cross_shard` optimizer `spec` describes: its all-reduce over the
    axes reduced by the mode (None: none is), its per-shard clip and its guarded update.

    Raises:
      ValueError: for a bad ``comm_dtype`` or ``clip_per_shard``.
    """
    mode_axes = spec.axes.mode_axes(spec.axis_name)
    reducer = None
    if mode_axes:
        reducer = AllReduce.build(
            spec.reduction,
            axis_name=mode_axes,
            comm_dtype=spec.comm_dtype,
            num_shards=spec.num_shards,
        )
    clip = spec.clip_per_shard
    return CrossShardUpdate(
        spec,
        optax.with_extra_args_support(spec.inner),
        None if clip is None else per_shard_clip(clip, spec.step_axes),
        reducer,
        guarded_update(
            spec.inner, skip_nonfinite=spec.skip_nonfinite, track_stats=spec.track_stats
        ),
    )


def over_axes(
    tx: CrossShardTransformation, axis_name: AxisNames, *, num_shards: int | None = None
) -> CrossShardTransformation:
    """`tx` rebuilt to reduce over `axis_name`: the same inner optimizer, mode, clipping, codec,
    guard, statistics and every-step axis rules (its periodic axes are left out: name one in
    `axis_name` to reduce over it every step). Its state has the structure of `tx`'s, so the
    two can take turns on one state: a periodic axis's synchronous warm-up steps
    (`xshard.config.axes.AxisRule.warmup_steps`) run this over the periodic axis too.

    Args:
      tx: a `cross_shard` optimizer.
      axis_name: the axes to reduce over.
      num_shards: the shard count of `axis_name` for SUM outside shard_map (None: from the
        mesh in context).
    """
    spec = tx.spec
    return cross_shard(
        spec.inner,
        spec.reduction,
        axis_name=axis_name,
        clip_per_shard=spec.clip_per_shard,
        comm_dtype=spec.comm_dtype,
        skip_nonfinite=spec.skip_nonfinite,
        num_shards=num_shards,
        track_stats=spec.track_stats,
        axes=dict(spec.axes.rules) or None,
    )
