"""The computations the branches of a guarded update run (`xshard.guard.update.GuardedUpdate`): the
update applied or skipped, and the statistics of the step's level.

`GuardedStep` holds one call's arguments; `branch_levels` turns the flags of a call (statistics,
per-leaf norms, histograms: Python bools prune levels when tracing, traced ones select one at
run time) into the levels a switch serves.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from xshard.guard.state import Guarded, SkipIfNonFiniteState, StepRecord, counted
from xshard.mesh.vma import as_varying, varying_axes
from xshard.stats.layers import Histograms, leaf_histograms
from xshard.stats.tree import (
    Flag,
    GradSummary,
    count_nonfinite,
    finite_values,
    leaf_sq_norms,
    nan_like,
    tree_max_abs,
    worth_splitting,
)


class GuardSettings(Protocol):
    """What the branches read of the `xshard.guard.update.GuardedUpdate` called."""

    @property
    def inner(self) -> optax.GradientTransformationExtraArgs: ...
    @property
    def track_stats(self) -> bool: ...
    @property
    def bins(self) -> int: ...


def _values(flag: Flag) -> tuple[bool, ...]:
    """The values `flag` may take at run time."""
    if flag is None or flag is True:
        return (True,)
    if flag is False:
        return (False,)
    return (False, True)


def _position(flag: Flag, values: tuple[bool, ...]) -> jax.Array | int:
    return 0 if len(values) == 1 else jnp.asarray(flag, jnp.int32)


def _vary_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` cast to varying over the manual axes `ref` varies over and it does not."""
    return as_varying(x, varying_axes(ref))


def _zeros_like_abstract(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `aval`'s shape and dtype, varying over the same manual axes (in shard_map)."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    mat = getattr(aval, "manual_axis_type", None)
    varying = tuple(sorted(getattr(mat, "varying", ()) or ()))
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


class Stepped(NamedTuple):
    """The inner update of a step, applied (`GuardedStep.step`) or skipped (``skip``)."""

    out: Any
    inner_state: optax.OptState
    updates: Any


class Statistics(NamedTuple):
    """What a step's level computes besides the update (`GuardedStep.statistics`)."""

    max_abs: jax.Array
    leaf_norms: jax.Array
    measured: Any
    histograms: Histograms | optax.EmptyState


class BranchLevels(NamedTuple):
    """The levels a guarded update serves, each ``(statistics, per-leaf norms, histograms)``.

    Attributes:
      levels: the distinct levels the flags' values may select (per-leaf norms are a
        statistic: no level has them without the statistics).
      served: every statistic any level computes: what a rare, non-finite step computes.
      level: the step's level, an index into `levels` (traced where there are several).
    """

    levels: list[tuple[bool, bool, bool]]
    served: tuple[bool, bool, bool]
    level: jax.Array | int


def branch_levels(flags: tuple[Flag, Flag, Flag]) -> BranchLevels:
    """The `BranchLevels` of the flags ``(with_stats, layer_norms, histograms)``, each None, a
    Python bool or a traced bool (None: true)."""
    values = [_values(f) for f in flags]
    combinations = list(itertools.product(*values))
    level_of = [(s, s and lv, h) for s, lv, h in combinations]
    levels = list(dict.fromkeys(level_of))
    served = (values[0][-1], values[1][-1], values[2][-1])  # the largest value of each
    index: jax.Array | int = 0
    if len(levels) > 1:
        position: jax.Array | int = 0
        for flag, vals in zip(flags, values, strict=True):
            position = position * len(vals) + _position(flag, vals)
        table = [levels.index(lv) for lv in level_of]
        index = jnp.asarray(table, jnp.int32)[position]
    return BranchLevels(levels, served, index)


@dataclasses.dataclass(frozen=True, eq=False)  # holds tracers: compared by identity
class GuardedStep:
    """One call of a `GuardedUpdate`: its arguments, and the computations its branches run.

    Attributes:
      guard: the `GuardedUpdate` called.
      gradient, finalize, skipped, max_abs, shard_axes, measure: its arguments.
      total: the gradient's squared global norm (float32).
      n: the gradient's number of leaves.
      levels: the levels served, and the step's.
      extra: the inner optimizer's extra arguments.
      params, inner_state: the call's params and inner state (for shapes only: the branches
        read their own operands).
    """

    guard: GuardSettings
    gradient: Callable[[], Any]
    total: jax.Array
    n: int
    levels: BranchLevels
    finalize: Callable[[Any, Any], Any]
    skipped: Callable[[Any], Any] | None
    max_abs: Callable[[], jax.Array] | None
    shard_axes: tuple[str, ...] | None
    measure: Callable[[Any, Any, GradSummary], Any] | None
    extra: dict[str, Any]
    params: Any
    inner_state: optax.OptState

    # ------------------------------------------------------------------ the update

    def step(self, g: Any, params: Any, inner_state: optax.OptState) -> Stepped:
        """The inner update on `g`, finalized."""
        updates, new_inner = self.guard.inner.update(g, inner_state, params, **self.extra)
        return Stepped(self.finalize(params, updates), new_inner, updates)

    def skip(self, g: Any, params: Any, inner_state: optax.OptState) -> Stepped:
        """A skipped update: zero updates, the inner state as it was."""
        shapes = jax.eval_shape(self.step, g, params, inner_state).updates
        updates = jax.tree.map(_zeros_like_abstract, shapes)
        out = self.finalize(params, updates) if self.skipped is None else self.skipped(params)
        return Stepped(out, inner_state, updates)

    def unbranched(
        self, finite_sum: jax.Array, params: Any, guard_state: SkipIfNonFiniteState
    ) -> Guarded:
        """Without `skip_nonfinite`: the update outside any branch, its statistics in one."""
        stepped = self.step(self.gradient(), params, guard_state.inner_state)
        applied = jnp.ones((), jnp.bool_)
        levels = self.levels.levels
        if len(levels) == 1 and not levels[0][0]:  # no statistic reads the update
            out, updates = None, None
        else:
            out, updates = stepped.out, stepped.updates
        record = jax.lax.cond(
            finite_sum,
            lambda: self.finite_statistics(out, updates),
            lambda: self.rare_statistics(out, updates, applied),
        )
        new_state = guard_state._replace(inner_state=stepped.inner_state)
        return Guarded(stepped.out, new_state, record)

    def finite(self, operands: tuple[Any, SkipIfNonFiniteState]) -> Guarded:
        """Every element is finite: update, then the statistics of the step's level."""
        params, state = operands
        g = self.gradient()
        stepped = self.step(g, params, state.inner_state)
        # Only statistics leave the nested switch: a nested branch that returned the
        # state would make XLA copy the donated state every step.
        applied = jnp.ones((), jnp.bool_)
        record = self.finite_statistics(stepped.out, stepped.updates)
        inner_state = _varying_like(stepped.inner_state, state.inner_state)
        return Guarded(stepped.out, counted(state, applied, inner_state), record)

    def rare(self, operands: tuple[Any, SkipIfNonFiniteState]) -> Guarded:
        """Skipped: the state as it was, with every statistic the program serves."""
        params, state = operands
        g = self.gradient()
        stepped = self.skip(g, params, state.inner_state)
        applied = jnp.zeros((), jnp.bool_)
        record = self.rare_statistics(stepped.out, stepped.updates, applied)
        return Guarded(stepped.out, counted(state, applied, stepped.inner_state), record)

    # ------------------------------------------------------------------ the statistics

    def finite_summary(self) -> GradSummary:
        """A finite gradient's summary: its norm, no non-finite element."""
        return GradSummary(jnp.sqrt(self.total), None, jnp.zeros((), jnp.int32), None)

    def rare_summary(self, g: Any) -> tuple[GradSummary, Any]:
        """A gradient with non-finite elements: (the summary of its finite ones, those)."""
        nonfinite, seen = count_nonfinite(g), finite_values(g)
        clean = leaf_sq_norms(seen)
        return GradSummary(jnp.sqrt(jnp.sum(clean)), None, nonfinite, jnp.sqrt(clean)), seen

    def finite_statistics(self, out: Any, updates: Any) -> StepRecord:
        """The statistics of the step's level (a switch over the levels served)."""
        summary = self.finite_summary()
        per_level = [
            functools.partial(self._at_level, out, updates, summary, *lv)
            for lv in self.levels.levels
        ]
        if len(per_level) == 1:
            stats = per_level[0]()
        else:
            stats = jax.lax.switch(self.levels.level, per_level)
        return self.record(summary, jnp.ones((), jnp.bool_), stats)

    def _at_level(
        self, out: Any, updates: Any, summary: GradSummary, stats: bool, layers: bool, hist: bool
    ) -> Statistics:
        g = self.gradient()  # called in the branch: its slices fuse there
        return self.statistics(g, g, out, updates, summary, stats, layers, hist)

    def rare_statistics(self, out: Any, updates: Any, applied: jax.Array) -> StepRecord:
        """Every statistic the program serves: a non-finite gradient is rare."""
        g = self.gradient()
        summary, seen = self.rare_summary(g)
        stats = self.statistics(g, seen, out, updates, summary, *self.levels.served)
        return self.record(summary, applied, stats)

    def statistics(
        self,
        g: Any,
        seen: Any,
        out: Any,
        updates: Any,
        summary: GradSummary,
        stats: bool,
        layers: bool,
        hist: bool,
    ) -> Statistics:
        """max |g|, the per-leaf norms, the caller's measurements and the histograms, at a
        level (`seen`: the finite values of `g`)."""
        track_stats = self.guard.track_stats
        split = self._split(g)
        norms = summary.leaf_norms
        if norms is None:  # finite gradient: the leaf norms are a statistic
            norms = jnp.full((self.n,), jnp.nan)
            if layers:
                norms = jnp.sqrt(leaf_sq_norms(g, split["sq_norms"]))
        biggest = jnp.full((), jnp.nan)
        if stats and track_stats:
            packed = self.max_abs is not None and seen is g  # the packed buffer's maximum
            biggest = self.max_abs() if packed and self.max_abs else tree_max_abs(seen)
        measured = None
        if self.measure is not None:
            summary = summary._replace(leaf_norms=norms)
            measured = self.measure(out, updates, summary) if stats else self.unmeasured()
        hists: Histograms | optax.EmptyState = optax.EmptyState()
        if track_stats:
            compute = lambda: leaf_histograms(g, self.guard.bins, split["histograms"])
            hists = compute() if hist else nan_like(jax.eval_shape(compute))
        return Statistics(jnp.asarray(biggest, jnp.float32), norms, measured, hists)

    def _split(self, g: Any) -> dict[str, tuple[str, ...] | None]:
        """Per per-leaf statistic, the axes its work is split over (None: whole here).

        Inside shard_map the reduced gradient is the same on every shard: each reads its 1/N
        for the per-leaf statistics (a shard's own slice, after a scatter, is not split).
        """
        axes = self.shard_axes
        same = axes and not any(varying_axes(x) & set(axes) for x in jax.tree.leaves(g))
        return {
            statistic: axes if same and worth_splitting(g, statistic) else None
            for statistic in ("sq_norms", "histograms")
        }

    def unmeasured(self) -> Any:
        """NaN like `measure`'s result (from shapes only: no update needs to exist)."""
        assert self.measure is not None
        measure = self.measure

        def shapes(params: Any, inner_state: optax.OptState) -> Any:
            stepped = self.step(self.gradient(), params, inner_state)
            norms = jnp.zeros((self.n,), jnp.float32)
            summary = self.finite_summary()._replace(leaf_norms=norms)
            return measure(stepped.out, stepped.updates, summary)

        return nan_like(jax.eval_shape(shapes, self.params, self.inner_state))

    def record(self, summary: GradSummary, applied: jax.Array, stats: Statistics) -> StepRecord:
        """The `StepRecord` of a branch."""
        summary = summary._replace(max_abs=stats.max_abs, leaf_norms=stats.leaf_norms)
        # Constants vary like the gradient (over the axes it was not reduced over).
        summary = jax.tree.map(lambda x: _vary_like(x, self.total), summary)
        return StepRecord(summary, stats.histograms, applied, stats.measured)


def _varying_like(new: Any, old: Any) -> Any:
    """`new` (a state) varying over the manual axes `old`'s leaves vary over, as the skipped
    branch returns `old`: a leaf the update recomputes from constants (an injected constant
    learning rate) is otherwise invariant where the state held per replica is varying (a
    periodic axis, `xshard.reduce.periodic`), and the two branches' types would differ."""

    return jax.tree.map(lambda n, o: as_varying(n, varying_axes(o)), new, old)
