"""Per-shard statistics of the local gradients, for `cross_shard` to record in its state.

Inside ``jax.shard_map``, each shard's local gradient norm, taken before per-shard clipping,
is combined across the data axes (scalar collectives only) into `ShardStats`: the norms' mean/max/min/std and the two terms of the gradient noise scale of
McCandlish et al. (2018), App. A, both taken where they are exact:

* |G_small|^2 — the mean over shards of the local squared norm, *before* clipping;
* |G_big|^2 — the squared norm of the mean over shards of the *unclipped, unweighted*
  gradients. Without per-shard clipping or weighting that mean is the reduced gradient
  (divided by the shard count under SUM): no extra communication (`with_reduced_norm` fills
  it in after the reduction). With per-shard clipping, it is still the reduced gradient on a
  step where no shard was clipped (known from the max of the norms, one scalar collective
  already taken); only when some shard was clipped, or with ``shard_weight``, is the unclipped
  gradient averaged once more (``pmean``), and only on statistics steps.

The exact identity |mean g_i|^2 = (1/N^2) sum_ij <g_i, g_j> is no cheaper: the cross terms
need every shard's gradient on every shard (an all-gather, N times the data of one pmean).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from xshard.stats import shard_norm_stats, tree_norm


class ShardStats(NamedTuple):
    """Per-shard gradient statistics of the last statistics step (float32; NaN otherwise)."""

    norm_mean: jax.Array  # mean over shards of the local gradient norm, before clipping
    norm_max: jax.Array
    norm_min: jax.Array
    norm_std: jax.Array
    sq_norm_mean: jax.Array  # |G_small|^2: mean of the local squared norms, before clipping
    mean_sq_norm: jax.Array  # |G_big|^2: squared norm of the unclipped, unweighted mean


def empty_shard_stats() -> ShardStats:
    """NaN `ShardStats` (distinct buffers: a donated state must not alias one twice)."""
    return ShardStats(*(jnp.full((), jnp.nan, jnp.float32) for _ in ShardStats._fields))


def _sq_norm(tree: Any) -> jax.Array:
    return jnp.square(tree_norm(tree))


def local_shard_stats(
    local_grads: Any,
    axes: Sequence[str],
    *,
    norm: jax.Array | None = None,
    clip_norm: float | None = None,
    weighted: bool = False,
) -> tuple[ShardStats, jax.Array]:
    """`ShardStats` of the local (unclipped) gradients, inside shard_map over `axes`.

    Args:
      local_grads: this shard's gradient before clipping (varying over `axes`).
      axes: the manual data-parallel mesh axes.
      norm: `tree_norm(local_grads)` if the caller already has it.
      clip_norm: the per-shard clip norm, if the shards' gradients are clipped before the
        reduction.
      weighted: whether the reduction weights the shards (``shard_weight``).

    Returns:
      (stats, use_reduced): where `use_reduced` (a bool scalar) holds, ``mean_sq_norm`` is
      NaN and the reduced gradient is the unclipped mean: pass it to `with_reduced_norm`.
    """
    axes = tuple(axes)
    norms = shard_norm_stats(local_grads, axes, norm)

    def mean_sq_norm():
        return _sq_norm(jax.lax.pmean(local_grads, axes))

    if weighted:
        mean_sq, use_reduced = mean_sq_norm(), jnp.zeros((), jnp.bool_)
    elif clip_norm is not None:
        # No shard was clipped iff the longest local gradient was not: then the reduced
        # gradient is the unclipped mean. NaN norms take the pmean (and give NaN).
        use_reduced = norms["shard_norm_max"] < clip_norm
        mean_sq = jax.lax.cond(
            use_reduced, lambda: jnp.full((), jnp.nan, jnp.float32), mean_sq_norm
        )
    else:
        mean_sq, use_reduced = jnp.full((), jnp.nan, jnp.float32), jnp.ones((), jnp.bool_)
    stats = ShardStats(
        norms["shard_norm_mean"],
        norms["shard_norm_max"],
        norms["shard_norm_min"],
        norms["shard_norm_std"],
        norms["shard_sq_norm_mean"],
        mean_sq,
    )
    return stats, use_reduced


def with_reduced_norm(
    stats: ShardStats, use_reduced: jax.Array, reduced_norm: jax.Array, num_summed: int
) -> ShardStats:
    """Fills ``mean_sq_norm`` from the reduced gradient's norm where `use_reduced` holds.

    Args:
      stats, use_reduced: from `local_shard_stats`.
      reduced_norm: the global norm of the reduced gradient.
      num_summed: the reduced gradient is the mean times this (the shard count under SUM, 1
        under MEAN).
    """
    from_reduced = jnp.square(reduced_norm / num_summed)
    return stats._replace(mean_sq_norm=jnp.where(use_reduced, from_reduced, stats.mean_sq_norm))
