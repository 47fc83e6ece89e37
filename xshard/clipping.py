"""Clipping by global norm that records what it did, for logging without a second pass.

* `clip_to_norm` — optax's `clip_by_global_norm` arithmetic on a norm the caller already
  has (the per-shard clip of `xshard.reduce.per_shard_clip` shares it with the statistics).
* `clip_by_global_norm` — a drop-in for `optax.clip_by_global_norm` whose state records the
  norm before clipping, the norm after it and whether it fired (`GlobalClipState`). It computes
  the norm on every step anyway, so the record is free; `xshard.build_optimizer` uses it for
  the config's global ``clip``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.stats import tree_norm


def clip_to_norm(updates: Any, norm: jax.Array, max_norm: float) -> tuple[Any, jax.Array]:
    """Scales `updates`, whose global norm is `norm`, down to `max_norm` if it is longer.

    The arithmetic of `optax.clip_by_global_norm` (``t / norm * max_norm`` when the norm is
    not below `max_norm`), on a norm computed once by the caller.

    Args:
      updates: a gradient pytree.
      norm: its global L2 norm (a float32 scalar).
      max_norm: the norm to clip to (> 0).

    Returns:
      (the clipped updates, a bool scalar: whether they were scaled). A non-finite norm
      counts as clipped, as in optax (the updates become non-finite).
    """
    keep = norm < max_norm

    def clip(t):
        return jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm)

    return jax.tree.map(clip, updates), ~keep


class GlobalClipState(NamedTuple):
    """What the last `clip_by_global_norm` update did (float32 scalars)."""

    norm: jax.Array  # global norm of the updates before clipping
    clipped_norm: jax.Array  # after clipping: min(norm, max_norm) up to rounding; NaN if not finite
    fired: jax.Array  # 1.0 if the updates were scaled down, else 0.0


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` that records the norms and whether it fired in its state.

    Args:
      max_norm: the maximum global norm of the updates (> 0).

    Returns:
      An `optax.GradientTransformation` with state `GlobalClipState`. Under
      `xshard.guard.skip_if_nonfinite` a skipped step keeps the previous step's record.

    Raises:
      ValueError: for a `max_norm` that is not > 0.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"clip must be > 0 or None, got {max_norm!r}.")

    def init_fn(params):
        del params
        return GlobalClipState(
            jnp.full((), jnp.nan, jnp.float32),
            jnp.full((), jnp.nan, jnp.float32),
            jnp.zeros((), jnp.float32),
        )

    def update_fn(updates, state, params=None):
        del state, params
        norm = tree_norm(updates)
        clipped, fired = clip_to_norm(updates, norm, max_norm)
        finite = jnp.isfinite(norm)
        after = jnp.where(finite, jnp.minimum(norm, jnp.float32(max_norm)), jnp.nan)
        return clipped, GlobalClipState(norm, after, fired.astype(jnp.float32))

    return optax.GradientTransformation(init_fn, update_fn)
