"""Adasum over one mesh axis: a reduction rule that adds orthogonal gradients and averages
parallel ones (Maleki et al., 2021; Horovod's ``op=hvd.Adasum``).

For two gradients ``g1, g2`` (per tensor)::

    adasum(g1, g2) = (1 - g1.g2 / (2 |g1|^2)) g1 + (1 - g1.g2 / (2 |g2|^2)) g2

so ``adasum(g, g) = g`` (the mean) and ``adasum(g1, g2) = g1 + g2`` for ``g1 . g2 = 0`` (the
sum). A coefficient whose norm is zero is taken as 1 (the zero gradient adds nothing, and no
NaN appears). Over ``n = 2**k`` replicas it is applied recursively on a binary tree over the
replica index, as Horovod does: ``adasum(adasum(g0, g1), adasum(g2, g3))`` for ``n = 4``. It is
applied per tensor (leaf): the dot products and norms are each leaf's own.

The scheme: each leaf is all-gathered over the axis (``lax.all_gather(..., to="invarying")``)
and every replica evaluates the same tree in the same order in float32, so the result is
bitwise identical on every replica and invariant over the axis in JAX's type system (recursive
doubling with ``lax.ppermute`` sends ``log2 n`` copies instead of ``n - 1`` but leaves a value
JAX types as varying, which a ``shard_map`` cannot return as replicated). On a DCN axis of 2
slices both send one copy.

A non-power-of-two axis is refused (`check_adasum_axis_size`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_adasum_axis_size(size: int, key: str) -> None:
    """Refuses an Adasum axis whose size is not a power of two.

    Args:
      size: the number of replicas over the axis.
      key: what names the axis where it was configured (e.g. ``reduction.axes.slice.rule``
        or ``axis 'slice'``), for the message.

    Raises:
      ValueError: naming `key`, the size and what is allowed.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size & (size - 1):
        raise ValueError(
            f"{key}: Adasum needs a power-of-two number of replicas over the axis "
            f"(1, 2, 4, 8, ...), got {size!r}."
        )


def _coefficient(dot: jax.Array, sq_norm: jax.Array) -> jax.Array:
    """``1 - dot / (2 sq_norm)``, and 1 for a zero norm."""
    safe = jnp.where(sq_norm > 0, sq_norm, jnp.float32(1))
    return 1 - jnp.where(sq_norm > 0, dot / (2 * safe), jnp.float32(0))


def adasum_pair(g1: jax.Array, g2: jax.Array) -> jax.Array:
    """Adasum of two tensors (float32 arithmetic, `g1`'s dtype)."""
    a, b = g1.astype(jnp.float32), g2.astype(jnp.float32)
    dot = jnp.sum(a * b)
    combined = _coefficient(dot, jnp.sum(a * a)) * a + _coefficient(dot, jnp.sum(b * b)) * b
    return combined.astype(g1.dtype)


def adasum_tree(stacked: jax.Array) -> jax.Array:
    """Adasum of ``stacked[0], ..., stacked[n - 1]`` (``n`` a power of two) on the binary tree
    over the index: neighbours first, then pairs of pairs, ...

    Raises:
      ValueError: where ``n`` is not a power of two.
    """
    check_adasum_axis_size(stacked.shape[0], "adasum_tree's leading dimension")
    values = [stacked[i] for i in range(stacked.shape[0])]
    while len(values) > 1:
        values = [adasum_pair(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def adasum_all_reduce(x: Any, axis_name: str) -> Any:
    """Adasum of `x` over `axis_name`, per leaf, inside ``jax.shard_map``.

    Args:
      x: this replica's pytree (varying over the axis); None leaves pass through.
      axis_name: a manual mesh axis whose size is a power of two.

    Returns:
      The combined pytree, bitwise identical on every replica (invariant over the axis).

    Raises:
      ValueError: for an axis whose size is not a power of two (`check_adasum_axis_size`).
    """
    check_adasum_axis_size(jax.lax.axis_size(axis_name), f"axis {axis_name!r}")

    def leaf(g: jax.Array) -> jax.Array:
        return adasum_tree(jax.lax.all_gather(g, axis_name, to="invarying"))

    return jax.tree.map(leaf, x)


def adasum_bytes_sent(size: int, itemsize: int, axis_size: int) -> int:
    """Bytes one replica sends over the axis for `size` elements of `itemsize` bytes: its
    copy, to each of the ``n - 1`` others (ring all-gather)."""
    return (axis_size - 1) * size * itemsize
