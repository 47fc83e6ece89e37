"""The update of a `xshard.cross_shard` optimizer, step by step (`xshard.optim.cross_shard`'s module
docstring lists them): per-shard clip and reduction where the per-shard gradients are
(`CrossShardUpdate.reduce`), then statistics, the non-finite guard and the inner optimizer
(`CrossShardUpdate.finish` / `apply`). `xshard.optim.cross_shard.cross_shard` builds it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

from xshard.config.reduction import Reduction
from xshard.guard.update import GuardedUpdate, empty_summary, init_guard
from xshard.mesh.context import axes_are_manual, shards_in_context
from xshard.optim.cross_shard_types import (
    Applied,
    CrossShardSpec,
    CrossShardState,
    LocalReduction,
)
from xshard.optim.packed import PackedLeaves
from xshard.reduce.gradients import (
    AllReduce,
    PerShardClipState,
    PerShardGradientsRequired,
    Reduced,
)
from xshard.stats.layers import empty_histograms
from xshard.stats.shards import ShardStats, empty_shard_stats, local_norms, shard_stats
from xshard.stats.tree import Flag, GradSummary, when


@dataclasses.dataclass(frozen=True, eq=False)  # as a closure: equal only to itself
class CrossShardUpdate:
    """A `cross_shard` optimizer: its parts, and the steps of its update (module docstring).

    Attributes:
      spec: its settings.
      inner: the inner optimizer, with extra-args support.
      clip: the per-shard clip (`xshard.reduce.shard_clip.per_shard_clip`), or None.
      reducer: the reduction across shards by the mode (None: no axis left to it).
      guarded: steps 3-5, in one branch (`xshard.guard.update.GuardedUpdate`).
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
        return CrossShardState.of(
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
        if spec.track_stats and axes_are_manual(step_axes):  # local gradients exist here
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
        (`xshard.reduce.per_axis`): the reduced gradient and the rules' new state."""
        spec = self.spec
        ruled = tuple(a for a, _ in spec.axes.rules)
        if not axes_are_manual(ruled):
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
            shard_axes=axes if axes_are_manual(axes) else None,
            with_stats=with_stats,
            layer_norms=layer_norms,
            histograms=histograms,
            measure=functools.partial(self._measured_with_shards, local, measure),
            **extra_args,
        )
        record = guarded.record
        shards, measured = record.measured
        new_state = CrossShardState.of(
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
        comm = state.comm if local.comm is None else local.comm
        kept = state.recorded  # nothing measured: the records as they were
        new_state = CrossShardState(
            PackedLeaves.pack(kept._replace(clip=clip_state)), new_inner, comm
        )
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
                summed = shards_in_context(spec.step_axes, spec.num_shards)
            shards = shard_stats(local.shards, summary.norm, summed)
        return shards, (None if measure is None else measure(out, updates, summary))
