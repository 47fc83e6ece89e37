"""What the non-finite guard keeps and records: its state around the inner optimizer's, its
counters, and the record of the branch a guarded update took (`xshard.guard`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.stats.layers import Histograms
from xshard.stats.tree import (
    GradSummary,
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


class Guarded(NamedTuple):
    """A `GuardedUpdate`'s result."""

    out: Any  # ``finalize(params, updates)``, or ``skipped(params)`` for a skipped update
    state: SkipIfNonFiniteState  # the guard's new state around the inner optimizer's
    record: StepRecord  # what the branch taken recorded
