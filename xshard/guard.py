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

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.layer_stats import HISTOGRAM_BINS, Histograms, leaf_histograms
from xshard.stats import (
    Flag,
    GradSummary,
    count_nonfinite,
    finite_values,
    leaf_sq_norms,
    nan_like,
    tree_max_abs,
    tree_sq_norm,
    worth_splitting,
)


def empty_summary(params: Any = ()) -> GradSummary:
    """A `GradSummary` of zeros for a gradient shaped like `params` (distinct buffers: a
    donated state must not alias one twice)."""
    return GradSummary(
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.int32),
        jnp.zeros((len(jax.tree.leaves(params)),), jnp.float32),
    )


class SkipIfNonFiniteState(NamedTuple):
    """State of the non-finite guard (field names as `optax.ApplyIfFiniteState`)."""

    notfinite_count: jax.Array  # int32: skipped updates in a row, reset by a finite one
    last_finite: jax.Array  # bool: whether the last update was finite
    total_notfinite: jax.Array  # int32: skipped updates in total
    inner_state: optax.OptState


def init_guard(inner: optax.GradientTransformation, params: Any) -> SkipIfNonFiniteState:
    """The guard's initial state around `inner`'s."""
    return SkipIfNonFiniteState(
        jnp.zeros((), jnp.int32),
        jnp.ones((), jnp.bool_),
        jnp.zeros((), jnp.int32),
        inner.init(params),
    )


def counted(
    state: SkipIfNonFiniteState, applied: jax.Array, new_inner: optax.OptState
) -> SkipIfNonFiniteState:
    """The guard's next state: the skip counters after an update that was (not) `applied`."""
    bad = jnp.where(applied, 0, 1).astype(jnp.int32)
    return SkipIfNonFiniteState(
        jnp.where(applied, 0, state.notfinite_count + 1).astype(jnp.int32),
        applied,
        state.total_notfinite + bad,
        new_inner,
    )


class StepRecord(NamedTuple):
    """What the branch a `guarded_update` took recorded.

    Attributes:
      summary: the reduced gradient's `GradSummary`: its norms (of its finite elements when
        it has others), the non-finite count, and max |g| on statistics steps (else NaN).
      histograms: per-leaf `Histograms` of the gradient on histogram steps (else NaN), or
        `optax.EmptyState()` without statistics.
      applied: bool scalar, whether the update was applied (False: skipped).
      measured: the caller's ``measure`` on statistics steps (NaN elsewhere), or None.
    """

    summary: GradSummary
    histograms: Histograms | optax.EmptyState
    applied: jax.Array
    measured: Any


def _values(flag: Flag) -> tuple[bool, ...]:
    """The values `flag` may take at run time."""
    if flag is None or flag is True:
        return (True,)
    if flag is False:
        return (False,)
    return (False, True)


def _position(flag: Flag, values: tuple[bool, ...]) -> jax.Array | int:
    return 0 if len(values) == 1 else jnp.asarray(flag, jnp.int32)


def _varying(x: Any) -> frozenset[str]:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _vary_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` cast to varying over the manual axes `ref` varies over and it does not."""
    missing = tuple(sorted(_varying(ref) - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _zeros_like_abstract(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `aval`'s shape and dtype, varying over the same manual axes (in shard_map)."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    mat = getattr(aval, "manual_axis_type", None)
    varying = tuple(sorted(getattr(mat, "varying", ()) or ()))
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


def guarded_update(
    inner: optax.GradientTransformation,
    *,
    skip_nonfinite: bool,
    track_stats: bool,
    bins: int = HISTOGRAM_BINS,
) -> Callable[..., tuple[Any, optax.OptState, StepRecord]]:
    """The update of `inner` on a reduced gradient, guarded and measured in one branch.

    Args:
      inner: the optimizer (extra arguments are forwarded to it).
      skip_nonfinite: skip updates whose gradient holds a NaN or Inf (else apply them).
      track_stats: compute max |g| on statistics steps and histograms on histogram steps.
      bins: buckets of every histogram.

    Returns:
      ``run(gradient, sq_norm, guard_state, params, *, finalize, skipped=None,
      max_abs=None, shard_axes=None, with_stats=None, layer_norms=None, histograms=None,
      measure=None, **extra) -> (out, new guard state, StepRecord)``, where the guard state is a
      `SkipIfNonFiniteState` around the inner optimizer's (its counters advance in the
      branch taken, with `skip_nonfinite`). ``gradient()`` returns the reduced gradient; it
      is called in every computation that reads it, so that what it computes (slices of a
      packed buffer, ``pmean``'s division) fuses into its consumers there. ``sq_norm()`` and
      ``max_abs()`` return its squared global norm and its largest |g| (None: computed from
      ``gradient()``, a reduction per leaf). ``shard_axes``: the manual mesh axes inside
      ``shard_map`` (histograms are then split over the shards). ``finalize(params,
      updates)`` turns the inner
      optimizer's updates into `out` (`optax.apply_updates`, or the updates themselves);
      ``skipped(params)`` is `out` for a skipped update (default: `finalize` of zero
      updates). ``measure(out, updates, summary)`` returns a pytree of arrays computed on
      statistics steps (for a skipped update `out` is the skipped one and the updates are
      zeros). The flags are None, a Python bool or a traced bool: ``with_stats`` (default:
      every step) for max |g| and `measure`, ``layer_norms`` (default: with the statistics)
      for the per-leaf norms of a finite gradient, ``histograms`` (default: never).
    """
    inner = optax.with_extra_args_support(inner)

    def run(
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
    ):
        total = tree_sq_norm(gradient()) if sq_norm is None else sq_norm()
        n = len(jax.tree.leaves(jax.eval_shape(gradient)))
        hist_flag = (False if histograms is None else histograms) if track_stats else False
        layer_flag = with_stats if layer_norms is None else layer_norms
        flags = (with_stats, layer_flag, hist_flag)
        values = [_values(f) for f in flags]
        # The levels served, and the level of each combination of the flags' values: per-leaf
        # norms are a statistic, no level has them without the statistics.
        combinations = list(itertools.product(*values))
        level_of = [(s, s and lv, h) for s, lv, h in combinations]
        levels = list(dict.fromkeys(level_of))
        served = tuple(max(v) for v in values)  # what a rare, non-finite step computes

        def step(g, params, inner_state):
            updates, new_inner = inner.update(g, inner_state, params, **extra)
            return finalize(params, updates), new_inner, updates

        def skip(g, params, inner_state):
            shapes = jax.eval_shape(step, g, params, inner_state)[2]
            updates = jax.tree.map(_zeros_like_abstract, shapes)
            out = finalize(params, updates) if skipped is None else skipped(params)
            return out, inner_state, updates

        def statistics(g, seen, out, updates, summary, stats: bool, layers: bool, hist: bool):
            """(max |g|, per-leaf norms, the caller's measurements, histograms) at a level."""
            # Inside shard_map the reduced gradient is the same on every shard: each reads
            # its 1/N for the per-leaf statistics (a shard's own slice, after a scatter, is
            # not split).
            same = shard_axes and not any(_varying(x) & set(shard_axes) for x in jax.tree.leaves(g))
            split = {
                statistic: shard_axes if same and worth_splitting(g, statistic) else None
                for statistic in ("sq_norms", "histograms")
            }
            norms = summary.leaf_norms
            if norms is None:  # finite gradient: the leaf norms are a statistic
                norms = jnp.full((n,), jnp.nan)
                if layers:
                    norms = jnp.sqrt(leaf_sq_norms(g, split["sq_norms"]))
            biggest = jnp.full((), jnp.nan)
            if stats and track_stats:
                biggest = tree_max_abs(seen) if max_abs is None or seen is not g else max_abs()
            measured = None
            if measure is not None:
                summary = summary._replace(leaf_norms=norms)
                measured = measure(out, updates, summary) if stats else unmeasured()
            hists: Histograms | optax.EmptyState = optax.EmptyState()
            if track_stats:
                compute = lambda: leaf_histograms(g, bins, split["histograms"])
                hists = compute() if hist else nan_like(jax.eval_shape(compute))
            return jnp.asarray(biggest, jnp.float32), norms, measured, hists

        def unmeasured():
            """NaN like `measure`'s result (from shapes only: no update needs to exist)."""

            def shapes(params, inner_state):
                out, _, updates = step(gradient(), params, inner_state)
                summary = finite_summary()._replace(leaf_norms=jnp.zeros((n,), jnp.float32))
                return measure(out, updates, summary)

            return nan_like(jax.eval_shape(shapes, params, guard_state.inner_state))

        def record(summary, applied, stats_out):
            max_abs, norms, measured, hists = stats_out
            summary = summary._replace(max_abs=max_abs, leaf_norms=norms)
            # Constants vary like the gradient (over the axes it was not reduced over).
            summary = jax.tree.map(lambda x: _vary_like(x, total), summary)
            return StepRecord(summary, hists, applied, measured)

        def finite_summary():
            return GradSummary(jnp.sqrt(total), None, jnp.zeros((), jnp.int32), None)

        def rare_summary(g):
            nonfinite, seen = count_nonfinite(g), finite_values(g)
            clean = leaf_sq_norms(seen)
            return GradSummary(jnp.sqrt(jnp.sum(clean)), None, nonfinite, jnp.sqrt(clean)), seen

        def finite_statistics(out, updates):
            """The statistics of the step's level (a switch over the levels served)."""
            summary = finite_summary()

            def at_level(stats: bool, layers: bool, hist: bool):
                g = gradient()  # called in the branch: its slices fuse there
                return statistics(g, g, out, updates, summary, stats, layers, hist)

            per_level = [functools.partial(at_level, *lv) for lv in levels]
            stats_out = per_level[0]() if len(per_level) == 1 else jax.lax.switch(level, per_level)
            return record(summary, jnp.ones((), jnp.bool_), stats_out)

        def rare_statistics(out, updates, applied):
            """Every statistic the program serves: a non-finite gradient is rare."""
            g = gradient()
            summary, seen = rare_summary(g)
            return record(summary, applied, statistics(g, seen, out, updates, summary, *served))

        level: jax.Array | int = 0  # the traced index of the step's level among `levels`
        if len(levels) > 1:
            position: jax.Array | int = 0
            for flag, vals in zip(flags, values, strict=True):
                position = position * len(vals) + _position(flag, vals)
            table = [levels.index(lv) for lv in level_of]
            level = jnp.asarray(table, jnp.int32)[position]
        finite_sum = jnp.isfinite(total)  # False for a NaN or Inf, or an overflow of squares

        if not skip_nonfinite:  # the update outside any branch: only statistics branch
            out, new_inner, updates = step(gradient(), params, guard_state.inner_state)
            applied = jnp.ones((), jnp.bool_)
            if len(levels) == 1 and not levels[0][0]:  # no statistic reads the update
                out_, updates_ = None, None
            else:
                out_, updates_ = out, updates

            def finite_level():
                return finite_statistics(out_, updates_)

            rec = jax.lax.cond(
                finite_sum, finite_level, lambda: rare_statistics(out_, updates_, applied)
            )
            return out, guard_state._replace(inner_state=new_inner), rec

        def finite(operands):
            """Every element is finite: update, then the statistics of the step's level."""
            params, state = operands
            g = gradient()
            out, new_inner, updates = step(g, params, state.inner_state)
            # Only statistics leave the nested switch: a nested branch that returned the
            # state would make XLA copy the donated state every step.
            applied = jnp.ones((), jnp.bool_)
            return out, counted(state, applied, new_inner), finite_statistics(out, updates)

        def rare(operands):
            """Skipped: the state as it was, with every statistic the program serves."""
            params, state = operands
            g = gradient()
            out, new_inner, updates = skip(g, params, state.inner_state)
            applied = jnp.zeros((), jnp.bool_)
            record = rare_statistics(out, updates, applied)
            return out, counted(state, applied, new_inner), record

        # Two branches carry the state, and the counters advance in them: with more branches
        # (or a nested cond returning it), or the counters read after the cond, XLA:CPU
        # copies parts of the donated state on every step.
        return jax.lax.cond(finite_sum, finite, rare, (params, guard_state))

    return run
