"""The per-shard clip: each shard's own gradient clipped to a global norm before the reduction
(step 1 of `xshard.cross_shard`, ``clip_per_shard``), so that one shard's huge gradient does
not dominate the others'. It runs inside ``jax.shard_map`` on per-shard gradients
(`xshard.mesh.context`); the reduction that follows is `xshard.reduce`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.config.reduction import clip_norm
from xshard.errors import ConfigError
from xshard.mesh.context import AxisNames, axis_tuple, require_per_shard
from xshard.reduce.clipping import clip_recorded
from xshard.stats.tree import when


class PerShardClipState(NamedTuple):
    """State of `per_shard_clip`."""

    clipped_fraction: jax.Array  # f32: share of shards clipped on the last statistics step


def per_shard_clip(
    max_norm: float, axis_name: AxisNames = "data"
) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` of each shard's own gradient, before the reduction.

    TF reduced late for this: one shard's huge gradient must not dominate the others. Must run
    inside ``jax.shard_map`` on per-shard (varying) gradients.

    Args:
      max_norm: the global norm each shard's local gradient is clipped to (> 0).
      axis_name: the data-parallel mesh axis, or axes, the gradients vary over.

    Returns:
      A transformation with state `PerShardClipState`. Its `update` takes the extra
      arguments ``with_stats`` (None, a bool or a traced bool: record the fraction of shards
      that were clipped, one scalar ``pmean``; None: on every update, False: never, NaN).

    Raises:
      ValueError: for a `max_norm` that is not > 0; at update time,
        `PerShardGradientsRequired` outside shard_map and `DoubleReductionError` for
        gradients that are already reduced.
    """
    if clip_norm(max_norm) is None:
        raise ConfigError("clip_per_shard=None: per_shard_clip needs a global norm > 0.")
    axes = axis_tuple(axis_name)

    def init_fn(params):
        del params
        return PerShardClipState(jnp.full((), jnp.nan, jnp.float32))

    def update_fn(updates, state, params=None, *, with_stats=None, **extra):
        del state, params, extra
        require_per_shard(updates, axes, "clip_per_shard")
        clipped, _, fired = clip_recorded(updates, max_norm)
        fraction = when(with_stats, lambda: jax.lax.pmean(fired.astype(jnp.float32), axes))
        return clipped, PerShardClipState(fraction)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
