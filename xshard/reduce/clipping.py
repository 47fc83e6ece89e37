"""Clipping by global norm that records what it did, for logging without a second pass.

* `clip_recorded` — `optax.clip_by_global_norm`, plus the norm it compared and whether it
  fired (the per-shard clip of `xshard.reduce.shard_clip` uses it).
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


def clip_recorded(updates: Any, max_norm: float) -> tuple[Any, jax.Array, jax.Array]:
    """`optax.clip_by_global_norm` of `updates`, with the norm it compared and whether it fired.

    The clipping is optax's own transform; the norm is `optax.tree.norm` of the same updates,
    the expression optax compares with `max_norm`, so XLA computes it once for both.

    Args:
      updates: a gradient pytree.
      max_norm: the norm to clip to (> 0).

    Returns:
      (the clipped updates, their norm before clipping, a bool scalar: whether they were
      scaled). A non-finite norm counts as clipped, as in optax (the updates become
      non-finite).
    """
    norm = optax.tree.norm(updates)
    clipped, _ = optax.clip_by_global_norm(max_norm).update(updates, optax.EmptyState())
    return clipped, norm, ~(norm < max_norm)


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
      `xshard.guard.update.skip_if_nonfinite` a skipped step keeps the previous step's record.

    Raises:
      ValueError: for a `max_norm` that is not > 0.
    """
    number = isinstance(max_norm, int | float) and not isinstance(max_norm, bool)
    # An array is an input of the step (`xshard.optim.hyperparams`), checked as the config's.
    if not isinstance(max_norm, jax.Array) and not (number and max_norm > 0):
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
        clipped, norm, fired = clip_recorded(updates, max_norm)
        norm = norm.astype(jnp.float32)
        finite = jnp.isfinite(norm)
        after = jnp.where(finite, jnp.minimum(norm, jnp.float32(max_norm)), jnp.nan)
        return clipped, GlobalClipState(norm, after, fired.astype(jnp.float32))

    return optax.GradientTransformation(init_fn, update_fn)
