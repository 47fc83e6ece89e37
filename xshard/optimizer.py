"""The cross-shard optimizer: reduce gradients across data-parallel shards, then update.

`cross_shard` wraps any optax transformation, the way TensorFlow's TPU `CrossShardOptimizer`
wrapped a `tf.train.Optimizer`. It is a composition of small optax transforms, applied in this
order in one update:

1. `xshard.reduce.per_shard_clip` (``clip_per_shard``): `optax.clip_by_global_norm` of each
   shard's local gradient (the reason TF reduced late: one shard's huge gradient must not
   dominate the others);
2. `xshard.reduce.all_reduce`: SUM = ``psum``, MEAN = ``pmean``, or a weighted mean
   (``shard_weight``); see `xshard.reduce` for where the reduction happens. MEAN's division
   is left to the consumers of the sum, where XLA fuses it (`LocalReduction.gradient`);
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
carries its settings (`CrossShardSpec`) and its update in two phases (`CrossShardPhases`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Self

import jax
import optax

from xshard.guard import (
    GuardedUpdate,
    SkipIfNonFiniteState,
    empty_summary,
    guarded_update,
    init_guard,
)
from xshard.layer_stats import Histograms, empty_histograms
from xshard.reduce import (
    AllReduce,
    AxisNames,
    PerShardClipState,
    _manual_axes,
    _shards_in_context,
    axis_tuple,
    divide,
    per_shard_clip,
)
from xshard.reduction_mode import Reduction
from xshard.shard_stats import (
    LocalNorms,
    ShardStats,
    empty_shard_stats,
    local_norms,
    shard_stats,
)
from xshard.stats import Flag, GradSummary, tree_max_abs, tree_sq_norm, when


@dataclasses.dataclass(frozen=True)
class CrossShardSpec:
    """The settings of a `cross_shard` optimizer, checked and parsed, for code that runs it
    (the trainer reads them from `CrossShardTransformation.spec`)."""

    reduction: Reduction
    axis_name: tuple[str, ...]
    clip_per_shard: float | None
    comm_dtype: Any
    skip_nonfinite: bool
    track_stats: bool
    num_shards: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalReduction:
    """What the first phase of a `cross_shard` update leaves for the second (`CrossShardPhases`).

    Attributes:
      updates: the reduced gradient (whole on every shard, or its slice after a scatter), or,
        where `mean_over` > 1, the sum whose mean it is.
      clip: the per-shard clip's new state (`optax.EmptyState()` without one).
      shards: the local gradients' norms (`xshard.shard_stats.local_norms`; None where no
        per-shard gradients existed).
      parts: the buffers holding `updates`, packed per dtype (`xshard.reduce.Reduced`), or
        None: its leaves.
      mean_over: the shard count MEAN still divides `updates` by (static; 1: reduced).
      unpack: ``unpack(parts) -> updates`` where `parts` is set (static): `gradient` slices
        the leaves out of the buffers where it is called, so that the slices fuse into the
        consumers (inside the guard's branch, not before it as the branch's operands).
    """

    updates: Any
    clip: PerShardClipState | optax.EmptyState
    shards: LocalNorms | None
    parts: tuple[jax.Array, ...] | None = None
    mean_over: int = dataclasses.field(default=1, metadata={"static": True})
    unpack: Callable[[Any], Any] | None = dataclasses.field(default=None, metadata={"static": True})

    def gradient(self) -> Any:
        """The reduced gradient, divided where it is read (``pmean``'s arithmetic): call it in
        the computation that consumes it, so that XLA fuses the slicing and the division
        there."""
        if self.parts is None or self.unpack is None:
            return divide(self.updates, self.mean_over)
        return self.unpack(divide(list(self.parts), self.mean_over))

    def sq_norm(self) -> jax.Array:
        """The squared global norm of `gradient` (float32), read from the packed buffers."""
        if self.parts is None:
            return tree_sq_norm(self.gradient())
        return tree_sq_norm(divide(list(self.parts), self.mean_over))

    def max_abs(self) -> jax.Array:
        """max |`gradient`| (float32, NaN-propagating), read from the packed buffers: one
        reduction over them, not one per leaf."""
        if self.parts is None:
            return tree_max_abs(self.gradient())
        return tree_max_abs(list(self.parts)) / self.mean_over


class Applied(NamedTuple):
    """`CrossShardPhases.apply`'s result."""

    params: Any  # the new params
    state: CrossShardState  # the optimizer's new state
    measured: Any  # the caller's measurements (NaN off statistics steps; None without)


class CrossShardPhases(NamedTuple):
    """A `cross_shard` update in two phases, for trainers that run them in different places.

    ``reduce(grads, params, *, shard_weight=None, with_stats=None, scatter_dims=None)`` runs
    where the per-shard gradients are (inside ``shard_map``): per-shard clip, the local
    statistics and the reduction, optionally a reduce-scatter (`xshard.reduce.all_reduce`'s
    ``scatter_dims``); it returns a `LocalReduction`. ``finish(local, state, params, *,
    with_stats=None, layer_norms=None, histograms=None, **extra)`` runs the summary, the guard
    and the inner optimizer on the reduced gradient, anywhere (e.g. under GSPMD on sharded
    slices, where norms over a sharded tensor are global): it returns ``(updates, new
    state)``. Their composition is the optimizer's ``update``. ``apply(local, state, params,
    *, with_stats=None, layer_norms=None, histograms=None, measure=None, **extra)`` is
    ``finish`` followed by `optax.apply_updates`, the addition done in the branch that
    computes the updates (`xshard.guard.GuardedUpdate`), so that XLA fuses it with the inner
    update: it returns `Applied`, whose ``measured`` is ``measure(new_params, updates,
    summary)`` (optional) computed in that branch on statistics steps (NaN on the others;
    None without `measure`).
    """

    reduce: Callable[..., LocalReduction]
    finish: Callable[..., tuple[Any, CrossShardState]]
    apply: Callable[..., Applied]


class CrossShardState(NamedTuple):
    """State of `cross_shard`, in the order of the update's steps.

    The statistics fields hold `optax.EmptyState()` when the optimizer does not record them
    (no per-shard clipping; ``track_stats=False``).
    """

    clip: PerShardClipState | optax.EmptyState  # share of shards clipped (clip_per_shard)
    shards: ShardStats | optax.EmptyState  # per-shard norms before clipping, noise-scale terms
    reduced: GradSummary  # norm, max |g|, non-finite count, leaf norms of the reduced gradient
    histograms: Histograms | optax.EmptyState  # per-leaf histograms of that gradient
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


class CrossShardTransformation(optax.GradientTransformationExtraArgs):
    """What `cross_shard` returns: an `optax.GradientTransformationExtraArgs` that also says
    how it was built (`spec`) and splits its update in two (`phases`).

    It is optax's pair ``(init, update)``, so optax takes it wherever it takes a
    transformation (``optax.chain``, ``optax.apply_if_finite``, ``optax.partition``,
    ``isinstance(tx, optax.GradientTransformationExtraArgs)``); `spec` and `phases` are
    attributes, not fields, for code that runs the phases in different places
    (`trainers.Trainer`). A copy made with ``_replace`` has another update: it is a plain
    `optax.GradientTransformationExtraArgs`.
    """

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: optax.TransformUpdateExtraArgsFn,
        spec: CrossShardSpec,
        phases: CrossShardPhases,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.__dict__.update(_spec=spec, _phases=phases)
        return self

    @property
    def spec(self) -> CrossShardSpec:
        """The settings it was built with, checked and parsed."""
        return self.__dict__["_spec"]

    @property
    def phases(self) -> CrossShardPhases:
        """Its update in two phases: `CrossShardPhases`."""
        return self.__dict__["_phases"]

    def _replace(self, /, **fields: Any) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(**(self._asdict() | fields))

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy.copy, pickle
        return (*self, self.spec, self.phases)


# A pytree like optax's pair (its two functions), `spec` and `phases` its static data.
jax.tree_util.register_pytree_node(
    CrossShardTransformation,
    lambda tx: (tuple(tx), (tx.spec, tx.phases)),
    lambda static, pair: CrossShardTransformation(*pair, *static),  # type: ignore[call-arg]
)


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
      ValueError: at construction for an unknown reduction or bad clip value; at update time
        (`DoubleReductionError`) when gradients are already reduced over the axis.
    """
    axes = axis_tuple(axis_name)
    reducer = AllReduce.build(
        reduction, axis_name=axes, comm_dtype=comm_dtype, num_shards=num_shards
    )
    spec = CrossShardSpec(
        reducer.mode, axes, clip_per_shard, comm_dtype, skip_nonfinite, track_stats, num_shards
    )
    parts = _CrossShard(
        spec,
        optax.with_extra_args_support(inner),
        None if clip_per_shard is None else per_shard_clip(clip_per_shard, axes),
        reducer,
        guarded_update(inner, skip_nonfinite=skip_nonfinite, track_stats=track_stats),
    )
    phases = CrossShardPhases(parts.reduce, parts.finish, parts.apply)
    return CrossShardTransformation(parts.init, parts.update, spec, phases)


@dataclasses.dataclass(frozen=True, eq=False)  # as a closure: equal only to itself
class _CrossShard:
    """A `cross_shard` optimizer: its parts, and the steps of its update (module docstring).

    Attributes:
      spec: its settings.
      inner: the inner optimizer, with extra-args support.
      clip: the per-shard clip (`xshard.reduce.per_shard_clip`), or None.
      reducer: the reduction across shards.
      guarded: steps 3-5, in one branch (`xshard.guard.GuardedUpdate`).
    """

    spec: CrossShardSpec
    inner: optax.GradientTransformationExtraArgs
    clip: optax.GradientTransformationExtraArgs | None
    reducer: AllReduce
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
        local = self.reduce(updates, params, shard_weight=shard_weight, with_stats=with_stats)
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
    ) -> LocalReduction:
        """Steps 1-2 and the local gradients' statistics: where the shards' gradients are."""
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
        if spec.track_stats and _manual_axes(spec.axis_name):  # local gradients exist here
            local = local_norms(
                raw,
                spec.axis_name,
                with_stats=with_stats,
                clip_norm=spec.clip_per_shard,
                weighted=shard_weight is not None,
            )
        reduced = self.reducer.reduced(
            updates, shard_weight=shard_weight, scatter_dims=scatter_dims, defer_mean=True
        )
        return LocalReduction(
            reduced.tree, clip_state, local, reduced.parts, reduced.mean_over, reduced.unpack
        )

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
        axes = spec.axis_name
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
        return Applied(out, state._replace(clip=clip_state, guard=guard_state), measured)

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
                summed = _shards_in_context(spec.axis_name, spec.num_shards)
            shards = shard_stats(local.shards, summary.norm, summed)
        return shards, (None if measure is None else measure(out, updates, summary))
