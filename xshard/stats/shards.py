"""Per-shard statistics of the local gradients, for `cross_shard` to record in its state.

Inside ``jax.shard_map``, each shard's local gradient norm, taken before per-shard clipping,
is shared with every shard (`gather_norms`: a ``psum`` of each shard's norm at its own
position, which XLA merges into the gradient's all-reduce, so no collective of its own), and
summarized after the update (`ShardStats`): the norms' mean/max/min/std and the two terms of
the gradient noise scale of McCandlish et al. (2018), App. A, both taken where they are exact:

* |G_small|^2 — the mean over shards of the local squared norm, *before* clipping;
* |G_big|^2 — the squared norm of the mean over shards of the *unclipped, unweighted*
  gradients. Without per-shard clipping or weighting that mean is the reduced gradient
  (divided by the shard count under SUM): no extra communication (`shard_stats` takes it from
  the reduced norm). With per-shard clipping, it is still the reduced gradient on a step
  where no shard was clipped (known from the largest norm); only when some shard was clipped,
  or with ``shard_weight``, is the unclipped gradient averaged once more (``pmean``), and
  only on statistics steps.

The exact identity |mean g_i|^2 = (1/N^2) sum_ij <g_i, g_j> is no cheaper: the cross terms
need every shard's gradient on every shard (an all-gather, N times the data of one pmean).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from xshard.stats.tree import Flag, tree_sq_norm, when

_SHARD_FIELDS = ("norm_mean", "norm_max", "norm_min", "norm_std", "sq_norm_mean", "mean_sq_norm")


class ShardStats(NamedTuple):
    """Per-shard gradient statistics of the last statistics step (float32; NaN otherwise),
    packed into one f32[6] array: a step without statistics writes one buffer of NaN into
    the donated state, not six. Read them through the properties:

    * ``norm_mean``, ``norm_max``, ``norm_min``, ``norm_std`` — over shards, of the local
      gradient norm before clipping;
    * ``sq_norm_mean`` — |G_small|^2: the mean of the local squared norms, before clipping;
    * ``mean_sq_norm`` — |G_big|^2: the squared norm of the unclipped, unweighted mean.
    """

    values: jax.Array  # f32[6], in the order of the properties above

    @classmethod
    def of(cls, *values: jax.Array) -> ShardStats:
        """`ShardStats` of the six statistics, in the order of the properties."""
        return cls(jnp.stack([jnp.asarray(v, jnp.float32) for v in values]))

    def _field(self, name: str) -> jax.Array:
        return self.values[..., _SHARD_FIELDS.index(name)]

    @property
    def norm_mean(self) -> jax.Array:
        return self._field("norm_mean")

    @property
    def norm_max(self) -> jax.Array:
        return self._field("norm_max")

    @property
    def norm_min(self) -> jax.Array:
        return self._field("norm_min")

    @property
    def norm_std(self) -> jax.Array:
        return self._field("norm_std")

    @property
    def sq_norm_mean(self) -> jax.Array:
        return self._field("sq_norm_mean")

    @property
    def mean_sq_norm(self) -> jax.Array:
        return self._field("mean_sq_norm")


class LocalNorms(NamedTuple):
    """What the reduction's side of a step knows of the local gradients.

    Attributes:
      norms: f32[N], every shard's local gradient norm before clipping (NaN on steps without
        statistics), the same on every shard.
      mean_sq_norm: |G_big|^2 where the reduced gradient does not give it (per-shard clipping
        that fired, or weights), else NaN.
      use_reduced: bool, whether |G_big|^2 is the reduced gradient's squared norm.
    """

    norms: jax.Array
    mean_sq_norm: jax.Array
    use_reduced: jax.Array


def empty_shard_stats() -> ShardStats:
    """NaN `ShardStats`."""
    return ShardStats(jnp.full((len(_SHARD_FIELDS),), jnp.nan, jnp.float32))


def gather_norms(norm: jax.Array, axes: Sequence[str]) -> jax.Array:
    """f32[N]: every shard's `norm`, in the order of its index over `axes`, on every shard.

    A ``psum`` of each shard's norm at its own position: an all-reduce with add, like the
    gradient's, which XLA combines with it into one collective.
    """
    axes = tuple(axes)
    n = 1
    for a in axes:
        n *= jax.lax.axis_size(a)
    onehot = jax.nn.one_hot(jax.lax.axis_index(axes), n, dtype=jnp.float32)
    return jax.lax.psum(onehot * norm.astype(jnp.float32), axes)


def local_norms(
    local_grads: Any,
    axes: Sequence[str],
    *,
    with_stats: Flag,
    clip_norm: float | None = None,
    weighted: bool = False,
) -> LocalNorms:
    """`LocalNorms` of this shard's (unclipped) gradients, inside shard_map over `axes`.

    Args:
      local_grads: this shard's gradient before clipping (varying over `axes`).
      axes: the manual data-parallel mesh axes.
      with_stats: whether this step computes statistics (`xshard.stats.tree.when`): the norm is
        taken under it, the collective outside (to merge with the gradient's).
      clip_norm: the per-shard clip norm, if the shards' gradients are clipped before the
        reduction.
      weighted: whether the reduction weights the shards (``shard_weight``).
    """
    axes = tuple(axes)
    nan = lambda: jnp.full((), jnp.nan, jnp.float32)
    norm = when(with_stats, lambda: jnp.sqrt(tree_sq_norm(local_grads)))  # NaN: varying
    norms = gather_norms(norm, axes)

    def mean_sq_norm():
        return tree_sq_norm(jax.lax.pmean(local_grads, axes))

    if weighted:
        use_reduced = jnp.zeros((), jnp.bool_)
        mean_sq = when(with_stats, mean_sq_norm, nan)
    elif clip_norm is not None:
        # No shard was clipped iff the longest local gradient was not: then the reduced
        # gradient is the unclipped mean. NaN norms (no statistics) take the reduced one.
        use_reduced = ~(jnp.max(norms) >= clip_norm)
        mean_sq = when(with_stats, lambda: jax.lax.cond(use_reduced, nan, mean_sq_norm), nan)
    else:
        mean_sq, use_reduced = nan(), jnp.ones((), jnp.bool_)
    return LocalNorms(norms, mean_sq, use_reduced)


def shard_stats(local: LocalNorms, reduced_norm: jax.Array, num_summed: int) -> ShardStats:
    """`ShardStats` from the gathered norms and the reduced gradient's norm.

    Args:
      local: from `local_norms`.
      reduced_norm: the global norm of the reduced gradient.
      num_summed: the reduced gradient is the mean times this (the shard count under SUM, 1
        under MEAN).
    """
    norms = local.norms
    mean, sq_mean = jnp.mean(norms), jnp.mean(jnp.square(norms))
    from_reduced = jnp.square(reduced_norm / num_summed)
    return ShardStats.of(
        mean,
        jnp.max(norms),
        jnp.min(norms),
        jnp.sqrt(jnp.maximum(sq_mean - jnp.square(mean), 0.0)),
        sq_mean,
        jnp.where(local.use_reduced, from_reduced, local.mean_sq_norm),
    )
