"""The cross-shard optimizer: reduce gradients across data-parallel shards, then update.

`cross_shard` wraps any optax transformation, the way TensorFlow's TPU `CrossShardOptimizer`
wrapped a `tf.train.Optimizer`. It is a composition of small optax transforms, applied in this
order in one update:

1. `xshard.reduce.per_shard_clip` (``clip_per_shard``): `optax.clip_by_global_norm` of each
   shard's local gradient (the reason TF reduced late: one shard's huge gradient must not
   dominate the others);
2. `xshard.reduce.all_reduce`: SUM = ``psum``, MEAN = ``pmean``, or a weighted mean
   (``shard_weight``); see `xshard.reduce` for where the reduction happens. MEAN's division
   is left to the consumers of the sum, where XLA fuses it (`LocalReduction.gradient`). With
   per-axis rules (``axes``, `xshard.axis_reduce`) the mode reduces over the axes without a
   rule, then the every-step rule (at most one) over its axis (mean, sum or Adasum, in a
   codec, with error feedback kept in ``state.comm``); a periodic axis takes no part;
3. statistics (``track_stats``), kept in the state for logging without a second pass: the
   norms and non-finite count of the reduced gradient on every update, its max |g| and the
   local gradients' norms and noise-scale terms (`xshard.shard_stats`) on statistics updates
   (``with_stats``), per-leaf norms (``layer_norms``) and histograms on the updates that ask
   for them;
4. the non-finite guard (``skip_nonfinite``): after the reduction, so every shard takes the
   same decision;
5. the inner optimizer.

Steps 3-5 (and, in `CrossShardPhases.apply`, the addition of the updates to the params) run
in one branch of one `lax.cond` (`xshard.guard.GuardedUpdate`).

`cross_shard` returns a `CrossShardTransformation`: optax's ``(init, update)`` pair, which also
carries its settings (`CrossShardSpec`) and its update in two phases (`CrossShardPhases`); those
types live in `xshard.cross_shard_types`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from xshard.axis_reduce import AxisReductions
from xshard.axis_rules import AxisRule
from xshard.cross_shard_types import (
    Applied,
    CrossShardPhases,
    CrossShardSpec,
    CrossShardState,
    CrossShardTransformation,
    LocalReduction,
)
from xshard.guard import GuardedUpdate, empty_summary, guarded_update, init_guard
from xshard.layer_stats import empty_histograms
from xshard.reduce import (
    AllReduce,
    AxisNames,
    PerShardClipState,
    PerShardGradientsRequired,
    Reduced,
    _manual_axes,
    _shards_in_context,
    axis_tuple,
    per_shard_clip,
)
from xshard.reduction_mode import Reduction
from xshard.shard_stats import ShardStats, empty_shard_stats, local_norms, shard_stats
from xshard.stats import Flag, GradSummary, when

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
        (``state.reduced``, `xshard.stats.GradSummary`) and per-leaf histograms
        (``state.histograms``, `xshard.layer_stats.Histograms`); inside shard_map, of the
        local gradients their norms before clipping and the noise-scale terms
        (``state.shards``, `xshard.shard_stats.ShardStats`) and, with `clip_per_shard`, the
        share of shards clipped (``state.clip``).
      axes: per mesh axis of `axis_name`, how it reduces (`xshard.axis_rules.AxisRule`;
        None: every axis by `reduction`, as before). The gradient is reduced by `reduction`
        over the axes without a rule, then over the axis with an every-step rule (at most
        one) by its rule (mean, sum, Adasum) and codec, with its error-feedback residual in
        ``state.comm`` (`xshard.axis_reduce`); an axis with a periodic rule takes no part
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
    mode_axes = rules.mode_axes(names)
    mode = Reduction.parse(reduction)
    reducer = None
    if mode_axes:
        reducer = AllReduce.build(
            mode, axis_name=mode_axes, comm_dtype=comm_dtype, num_shards=num_shards
        )
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
    step_axes = spec.step_axes
    parts = _CrossShard(
        spec,
        optax.with_extra_args_support(inner),
        None if clip_per_shard is None else per_shard_clip(clip_per_shard, step_axes),
        reducer,
        guarded_update(inner, skip_nonfinite=skip_nonfinite, track_stats=track_stats),
    )
    phases = CrossShardPhases(parts.reduce, parts.finish, parts.apply)
    return CrossShardTransformation(parts.init, parts.update, spec, phases)


def over_axes(
    tx: CrossShardTransformation, axis_name: AxisNames, *, num_shards: int | None = None
) -> CrossShardTransformation:
    """`tx` rebuilt to reduce over `axis_name`: the same inner optimizer, mode, clipping, codec,
    guard, statistics and every-step axis rules (its periodic axes are left out: name one in
    `axis_name` to reduce over it every step). Its state has the structure of `tx`'s, so the
    two can take turns on one state: a periodic axis's synchronous warm-up steps
    (`xshard.axis_rules.AxisRule.warmup_steps`) run this over the periodic axis too.

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


@dataclasses.dataclass(frozen=True, eq=False)  # as a closure: equal only to itself
class _CrossShard:
    """A `cross_shard` optimizer: its parts, and the steps of its update (module docstring).

    Attributes:
      spec: its settings.
      inner: the inner optimizer, with extra-args support.
      clip: the per-shard clip (`xshard.reduce.per_shard_clip`), or None.
      reducer: the reduction across shards by the mode (None: no axis left to it).
      guarded: steps 3-5, in one branch (`xshard.guard.GuardedUpdate`).
    """

    spec: CrossShardSpec
    inner: optax.GradientTransformationExtraArgs
    clip: optax.GradientTransformationExtraArgs | None
    reducer: AllReduce | None
    guarded: GuardedUpdate

    def init(self, params: Any) -> CrossShardState:
        """The optimizer's initial state for `params`."""
        empty = optax.EmptyState()
        track = self.spec.track_stats
        return CrossShardState(
            empty if self.clip is None else self.clip.init(params),
            empty_shard_stats() if track else empty,
            empty_summary(params),
            empty_histograms(params) if track else empty,
            init_guard(self.inner, params),
            self.spec.axes.init(params),
        )

    def update(
        self,
        updates: Any,
        state: CrossShardState,
        params: Any = None,
        *,
        shard_weight: jax.Array | None = None,
        with_stats: Flag = None,
        layer_norms: Flag = None,
        histograms: Flag = None,
        **extra_args: Any,
    ) -> tuple[Any, CrossShardState]:
        """The optax update: `reduce`, then `finish`."""
        local = self.reduce(
            updates, params, shard_weight=shard_weight, with_stats=with_stats, comm=state.comm
        )
        return self.finish(
            local,
            state,
            params,
            with_stats=with_stats,
            layer_norms=layer_norms,
            histograms=histograms,
            **extra_args,
        )

    def reduce(
        self,
        updates: Any,
        params: Any = None,
        *,
        shard_weight: jax.Array | None = None,
        with_stats: Flag = None,
        scatter_dims: Any = None,
        comm: Any = None,
    ) -> LocalReduction:
        """Steps 1-2 and the local gradients' statistics: where the shards' gradients are.
        `comm` is the state's ``comm`` field (the axis rules' residuals): needed with
        every-step axis rules."""
        spec = self.spec
        raw = updates
        clip_state = optax.EmptyState() if self.clip is None else None
        if self.clip is not None:
            updates, clip_state = self.clip.update(
                updates,
                self.clip.init(params),
                params,
                with_stats=with_stats if spec.track_stats else False,
            )
        local = None
        step_axes = spec.step_axes
        if spec.track_stats and _manual_axes(step_axes):  # local gradients exist here
            local = local_norms(
                raw,
                step_axes,
                with_stats=with_stats,
                clip_norm=spec.clip_per_shard,
                weighted=shard_weight is not None,
            )
        if spec.axes.rules:
            tree, new_comm = self._reduce_by_rules(updates, shard_weight, scatter_dims, comm)
            return LocalReduction(tree, clip_state, local, comm=new_comm)
        reduced = Reduced(updates)
        if self.reducer is not None:
            reduced = self.reducer.reduced(
                updates, shard_weight=shard_weight, scatter_dims=scatter_dims, defer_mean=True
            )
        return LocalReduction(
            reduced.tree, clip_state, local, reduced.parts, None, reduced.mean_over, reduced.unpack
        )

    def _reduce_by_rules(
        self, updates: Any, shard_weight: jax.Array | None, scatter_dims: Any, comm: Any
    ) -> tuple[Any, Any]:
        """Step 2 with axis rules: by the mode over the other axes, then by each rule
        (`xshard.axis_reduce`): the reduced gradient and the rules' new state."""
        spec = self.spec
        ruled = tuple(a for a, _ in spec.axes.rules)
        if not _manual_axes(ruled):
            raise PerShardGradientsRequired(
                f"cross_shard's rules for axes {ruled!r} need per-shard gradients inside "
                "jax.shard_map with those axes manual (the trainer's grad_impl=manual)."
            )
        if shard_weight is not None or any(d is not None for d in jax.tree.leaves(scatter_dims)):
            raise ValueError(
                "cross_shard's axis rules take no shard_weight and no scatter_dims (ZeRO-2): "
                "the gradient is reduced whole over every axis."
            )
        tree = updates
        if self.reducer is not None:
            tree = self.reducer.update(updates, optax.EmptyState())[0]
        return spec.axes.reduce(tree, spec.reduction, comm)

    def finish(
        self,
        local: LocalReduction,
        state: CrossShardState,
        params: Any = None,
        *,
        with_stats: Flag = None,
        layer_norms: Flag = None,
        histograms: Flag = None,
        **extra_args: Any,
    ) -> tuple[Any, CrossShardState]:
        """Steps 3-5 on the reduced gradient: (updates, new state)."""
        done = self._after_reduction(
            local,
            state,
            params,
            finalize=lambda params, updates: updates,
            skipped=None,
            flags=(with_stats, layer_norms, histograms),
            measure=None,
            extra_args=extra_args,
        )
        return done.params, done.state

    def apply(
        self,
        local: LocalReduction,
        state: CrossShardState,
        params: Any,
        *,
        with_stats: Flag = None,
        layer_norms: Flag = None,
        histograms: Flag = None,
        measure: Callable[..., Any] | None = None,
        **extra_args: Any,
    ) -> Applied:
        """`finish`, then the updates applied to `params` in the same branch."""
        return self._after_reduction(
            local,
            state,
            params,
            finalize=optax.apply_updates,
            skipped=lambda params: params,
            flags=(with_stats, layer_norms, histograms),
            measure=measure,
            extra_args=extra_args,
        )

    def _after_reduction(
        self,
        local: LocalReduction,
        state: CrossShardState,
        params: Any,
        *,
        finalize: Callable[[Any, Any], Any],
        skipped: Callable[[Any], Any] | None,
        flags: tuple[Flag, Flag, Flag],
        measure: Callable[..., Any] | None,
        extra_args: dict[str, Any],
    ) -> Applied:
        """Steps 3-5 on the reduced gradient, wherever it is (sharded or not): `finalize` of
        the updates (as `Applied.params`), the new state, the caller's measurements."""
        spec = self.spec
        clip_state = state.clip if self.clip is None else local.clip
        with_stats, layer_norms, histograms = flags
        if not (spec.track_stats or spec.skip_nonfinite):  # nothing to check or record
            return self._unguarded(
                local, state, params, clip_state, finalize, measure, flags[0], extra_args
            )
        axes = spec.step_axes
        guarded = self.guarded(
            local.gradient,
            local.sq_norm,
            state.guard,
            params,
            finalize=finalize,
            skipped=skipped,
            max_abs=local.max_abs,
            shard_axes=axes if _manual_axes(axes) else None,
            with_stats=with_stats,
            layer_norms=layer_norms,
            histograms=histograms,
            measure=functools.partial(self._measured_with_shards, local, measure),
            **extra_args,
        )
        record = guarded.record
        shards, measured = record.measured
        new_state = CrossShardState(
            clip_state,
            state.shards if shards is None else shards,
            record.summary,
            record.histograms if spec.track_stats else state.histograms,
            guarded.state,
            state.comm if local.comm is None else local.comm,
        )
        return Applied(guarded.out, new_state, measured)

    def _unguarded(
        self,
        local: LocalReduction,
        state: CrossShardState,
        params: Any,
        clip_state: PerShardClipState | optax.EmptyState,
        finalize: Callable[[Any, Any], Any],
        measure: Callable[..., Any] | None,
        with_stats: Flag,
        extra_args: dict[str, Any],
    ) -> Applied:
        """Steps 3-5 with nothing to check or record: the inner update, no branch."""
        inner_state = state.guard.inner_state
        updates, new_inner = self.inner.update(local.gradient(), inner_state, params, **extra_args)
        out = finalize(params, updates)
        measured = None
        if measure is not None:
            measured = when(with_stats, lambda: measure(out, updates, state.reduced))
        guard_state = state.guard._replace(inner_state=new_inner)
        comm = state.comm if local.comm is None else local.comm
        new_state = state._replace(clip=clip_state, guard=guard_state, comm=comm)
        return Applied(out, new_state, measured)

    def _measured_with_shards(
        self,
        local: LocalReduction,
        measure: Callable[..., Any] | None,
        out: Any,
        updates: Any,
        summary: GradSummary,
    ) -> tuple[ShardStats | None, Any]:
        """The guard's ``measure``: the per-shard statistics (the noise scale's big-batch
        term comes from the reduced gradient's norm), and the caller's `measure`."""
        shards = None
        if local.shards is not None:
            spec = self.spec
            summed = 1
            if spec.reduction is Reduction.SUM:
                summed = _shards_in_context(spec.step_axes, spec.num_shards)
            shards = shard_stats(local.shards, summary.norm, summed)
        return shards, (None if measure is None else measure(out, updates, summary))
