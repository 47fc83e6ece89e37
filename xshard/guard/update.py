"""Everything after the reduction: the non-finite guard, the inner optimizer, its application
and the step's statistics, in as few branches as XLA needs.

A `lax.cond` is a fusion barrier, and XLA:CPU runs every branch as a nested program: each
cond a step takes costs about as much as a few kernels, and an update split over several conds
(statistics, guard, histograms, norms) is split into kernels too. `guarded_update` decides
with what is known before the update:

* whether the reduced gradient's **squared norm is finite**. It is taken on every step (one
  reduction over the packed gradient on CPU, what a finiteness check costs anyway), so the
  gradient's global norm comes free. Finite: every element is finite, and the inner update
  is computed and applied in one branch (XLA fuses them). Not finite: a NaN or Inf somewhere,
  or (|g| ~ 1e19) squares that overflowed float32; with `skip_nonfinite` the update is skipped
  and the state returned as it was (as `optax.apply_if_finite`), and the non-finite elements
  are counted. The gradient is the same on every shard after the reduction, so every shard
  takes the same branch. Exactly two branches carry the state: with a third, or a nested
  cond that returns it, XLA:CPU copies the donated params and optimizer state every step.
* the step's **level**, in a switch nested in the update's branch that returns statistics
  only: statistics steps also compute max |g|, the per-leaf norms and the caller's
  measurements of the result (e.g. the update's and the new params' norms), histogram steps
  the per-leaf histograms. Flags that are Python bools prune the levels when tracing.

Without `skip_nonfinite` the update is not in a branch at all (it compiles exactly as the
inner optimizer alone); only the statistics are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from xshard.guard.branches import BranchLevels, GuardedStep, branch_levels
from xshard.guard.state import (
    Guarded,
    SkipIfNonFiniteState,
    StepRecord,
    counted,
    empty_summary,
    init_guard,
)
from xshard.stats.layers import HISTOGRAM_BINS
from xshard.stats.tree import (
    Flag,
    GradSummary,
    tree_sq_norm,
)

__all__ = [
    "Guarded",
    "GuardedUpdate",
    "SkipIfNonFiniteState",
    "StepRecord",
    "counted",
    "empty_summary",
    "guarded_update",
    "init_guard",
]


@dataclasses.dataclass(frozen=True)
class GuardedUpdate:
    """The update of `inner` on a reduced gradient, guarded and measured in one branch
    (`guarded_update` builds it; calling it runs one update).

    Attributes:
      inner: the optimizer, with extra-args support (extra arguments are forwarded to it).
      skip_nonfinite: skip updates whose gradient holds a NaN or Inf (else apply them).
      track_stats: compute max |g| on statistics steps and histograms on histogram steps.
      bins: buckets of every histogram.
    """

    inner: optax.GradientTransformationExtraArgs
    skip_nonfinite: bool
    track_stats: bool
    bins: int = HISTOGRAM_BINS

    def __call__(
        self,
        gradient: Callable[[], Any],
        sq_norm: Callable[[], jax.Array] | None,
        guard_state: SkipIfNonFiniteState,
        params: Any,
        *,
        finalize: Callable[[Any, Any], Any],
        skipped: Callable[[Any], Any] | None = None,
        max_abs: Callable[[], jax.Array] | None = None,
        shard_axes: tuple[str, ...] | None = None,
        with_stats: Flag = None,
        layer_norms: Flag = None,
        histograms: Flag = None,
        measure: Callable[[Any, Any, GradSummary], Any] | None = None,
        **extra: Any,
    ) -> Guarded:
        """One guarded update.

        Args:
          gradient: ``gradient()`` returns the reduced gradient; it is called in every
            computation that reads it, so that what it computes (slices of a packed buffer,
            ``pmean``'s division) fuses into its consumers there.
          sq_norm: ``sq_norm()`` returns its squared global norm (None: computed from
            ``gradient()``, a reduction per leaf).
          guard_state: the `SkipIfNonFiniteState` around the inner optimizer's (its counters
            advance in the branch taken, with `skip_nonfinite`).
          params: the params the update is for.
          finalize: ``finalize(params, updates)`` turns the inner optimizer's updates into
            the result's `out` (`optax.apply_updates`, or the updates themselves).
          skipped: ``skipped(params)`` is `out` for a skipped update (default: `finalize`
            of zero updates).
          max_abs: ``max_abs()`` returns the gradient's largest |g| (None: computed from
            ``gradient()``).
          shard_axes: the manual mesh axes inside ``shard_map`` (histograms and per-leaf
            norms are then split over the shards).
          with_stats: None, a Python bool or a traced bool (as the other flags): max |g| and
            `measure` (default: every step).
          layer_norms: the per-leaf norms of a finite gradient (default: with the
            statistics).
          histograms: the per-leaf histograms (default: never).
          measure: ``measure(out, updates, summary)`` returns a pytree of arrays computed on
            statistics steps (for a skipped update `out` is the skipped one and the updates
            are zeros).
          **extra: forwarded to the inner optimizer.

        Returns:
          The `Guarded` result.
        """
        total = tree_sq_norm(gradient()) if sq_norm is None else sq_norm()
        step = GuardedStep(
            guard=self,
            gradient=gradient,
            total=total,
            n=len(jax.tree.leaves(jax.eval_shape(gradient))),
            levels=self._levels(with_stats, layer_norms, histograms),
            finalize=finalize,
            skipped=skipped,
            max_abs=max_abs,
            shard_axes=shard_axes,
            measure=measure,
            extra=extra,
            params=params,
            inner_state=guard_state.inner_state,
        )
        return self._run(step, params, guard_state)

    def _levels(self, with_stats: Flag, layer_norms: Flag, histograms: Flag) -> BranchLevels:
        """The levels a call with these flags serves (`__call__`'s arguments): histograms only
        where statistics are tracked (default: never), per-leaf norms by default with the
        statistics."""
        hist_flag = (False if histograms is None else histograms) if self.track_stats else False
        layer_flag = with_stats if layer_norms is None else layer_norms
        return branch_levels((with_stats, layer_flag, hist_flag))

    def _run(self, step: GuardedStep, params: Any, guard_state: SkipIfNonFiniteState) -> Guarded:
        """`step` run: applied where the gradient's squared norm is finite, else skipped (with
        `skip_nonfinite`; without, applied outside any branch)."""
        finite_sum = jnp.isfinite(step.total)  # False for a NaN or Inf, or an overflow of squares
        if not self.skip_nonfinite:  # the update outside any branch: only statistics branch
            return step.unbranched(finite_sum, params, guard_state)
        # Two branches carry the state, and the counters advance in them: with more branches
        # (or a nested cond returning it), or the counters read after the cond, XLA:CPU
        # copies parts of the donated state on every step.
        return jax.lax.cond(finite_sum, step.finite, step.rare, (params, guard_state))


def guarded_update(
    inner: optax.GradientTransformation,
    *,
    skip_nonfinite: bool,
    track_stats: bool,
    bins: int = HISTOGRAM_BINS,
) -> GuardedUpdate:
    """The update of `inner` on a reduced gradient, guarded and measured in one branch.

    Args:
      inner: the optimizer (extra arguments are forwarded to it).
      skip_nonfinite: skip updates whose gradient holds a NaN or Inf (else apply them).
      track_stats: compute max |g| on statistics steps and histograms on histogram steps.
      bins: buckets of every histogram.

    Returns:
      The `GuardedUpdate`: ``update(gradient, sq_norm, guard_state, params, *, finalize,
      ...) -> Guarded`` (see `GuardedUpdate.__call__`).
    """
    inner = optax.with_extra_args_support(inner)
    return GuardedUpdate(inner, skip_nonfinite, track_stats, bins)
