"""A reduction over a slow mesh axis of a value every device of a replica holds whole.

A periodic axis (``slice``: the DCN links between TPU slices) syncs a pseudo-gradient that each
device of a replica holds whole: within a replica the params are replicated over the other mesh
axes (or gathered so). Were every device to reduce it over the slow axis, the replica would send
it ``F`` times over the slow links, ``F`` the number of its devices (the product of the sizes of
the *inner* axes: every mesh axis but the slow one). `hierarchical_all_reduce` sends it once:

1. the value is flattened into one vector and cut into ``F`` equal *shares*;
2. device ``i`` of the replica reduces only share ``i`` over the slow axis, plainly (one
   all-reduce, scalars to average riding along in the same collective) or through a codec
   (`xshard.reduce.compressed.compressed_all_reduce`, with the share's own error-feedback residual);
3. the reduced shares are all-gathered over the inner axes (fast links: ICI), so every device
   ends with the whole reduced value, identical everywhere.

This is the hierarchical all-reduce XLA runs for a synchronous mean on a multi-slice mesh, less
its first stage (a reduce-scatter within the replica is not needed: the value is already equal
there): per device the slow axis carries ``1 / F`` of the data and the inner axes ``(F - 1) / F``
of it (`slow_bytes_sent`). Shares are contiguous in the flat vector (leaves in
`jax.tree.leaves` order), device ``i`` the ``i``-th in the order of ``lax.axis_index`` over the
inner axes.

Call it inside ``jax.shard_map`` manual over the slow axis, with the inner axes not manual (it
opens its own ``shard_map`` over them), or with them manual too (`reduce_shares`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from xshard.mesh.vma import as_varying
from xshard.reduce.codecs import Codec, get_codec
from xshard.reduce.compressed import (
    bytes_sent,
    compressed_all_reduce,
    flatten,
    padded_size,
    tree_size,
    unflatten,
)

RULES = ("mean", "sum")


class HierarchicalReduce(NamedTuple):
    """`hierarchical_all_reduce`'s result.

    Attributes:
      value: the reduced pytree, identical on every device (invariant over every axis reduced).
      residual: the new error-feedback residuals of the replica's shares, ``(F, share_size)``
        (row ``i`` device ``i``'s), or None where none were given.
      error_sq: float32, the squared compression error norm of the whole message, summed over
        a replica's shares and averaged over the slow axis (0 for a lossless reduction).
      extra: the `extra` scalars averaged over the slow axis (float32).
    """

    value: Any
    residual: jax.Array | None
    error_sq: jax.Array
    extra: jax.Array


def share_size(size: int, axis_size: int, inner_size: int, codec: str | Codec) -> int:
    """Elements of one device's share of `size` elements: ``ceil(size / inner_size)``, with a
    codec padded to whole blocks per replica of the slow axis (`padded_size`), so that the
    compressed reduction of a share pads nothing more."""
    codec = get_codec(codec)
    share = max(1, -(-size // inner_size))
    return share if codec.identity else padded_size(share, axis_size, codec.block_size)


def slow_bytes_sent(
    size: int, axis_size: int, inner_size: int, codec: str | Codec, itemsize: int = 4
) -> int:
    """Bytes one device sends over the slow axis to reduce `size` elements of `itemsize`
    bytes: a ring all-reduce of its share, or its codec's traffic for the share
    (`xshard.reduce.compressed.bytes_sent`)."""
    codec = get_codec(codec)
    share = share_size(size, axis_size, inner_size, codec)
    if codec.identity:
        return 2 * (axis_size - 1) * share * itemsize // axis_size
    return bytes_sent(share, axis_size, codec)


def all_reduce_bytes_per_axis(
    axis_sizes: Sequence[tuple[str, int]], size: int, itemsize: int = 4
) -> dict[str, int]:
    """Bytes one device sends over each axis to all-reduce `size` elements of `itemsize` bytes
    over all of `axis_sizes` (``(name, size)``, outer axes first), hierarchically: the innermost
    axis reduce-scatters and all-gathers the whole value, each outer axis all-reduces the share
    its inner axes leave (`slow_bytes_sent`): what XLA runs for a synchronous mean on a
    multi-slice mesh. Axes of size 1 send nothing and are left out."""
    axes = [(name, n) for name, n in axis_sizes if n > 1]
    return {
        name: slow_bytes_sent(size, n, math.prod(m for _, m in axes[i + 1 :]), "float32", itemsize)
        for i, (name, n) in enumerate(axes)
    }


def residual_spec(axis: str, inner_axes: tuple[str, ...]) -> P:
    """Where error-feedback residuals of shares, ``(axis size, F, share)``, live at rest: a row
    per device, over `axis` and the inner axes."""
    if not inner_axes:
        return P(axis)
    return P(axis, inner_axes[0] if len(inner_axes) == 1 else inner_axes)


def reduce_shares(
    vec: jax.Array,
    axis: str,
    inner_axes: tuple[str, ...],
    codec: Codec,
    rule: str,
    residual: jax.Array | None,
    extra: jax.Array,
) -> HierarchicalReduce:
    """Steps 2-3 of the module docstring with `axis` and `inner_axes` all manual: `vec` (the
    flat value, ``F * share`` long, equal on the replica's devices) reduced over `axis`, its
    share `residual` (``(1, share)``, this device's row) and `extra` scalars alongside. The
    result's ``value`` is the reduced flat vector."""
    n = jax.lax.axis_size(axis)
    inner = math.prod(jax.lax.axis_size(a) for a in inner_axes)
    share = vec.shape[0] // inner
    index = jax.lax.axis_index(inner_axes) if inner_axes else 0
    mine = jax.lax.dynamic_slice_in_dim(vec, index * share, share)
    new_residual = residual
    if codec.identity:  # one all-reduce: XLA carries the share and the scalars in one tuple
        mine, extra = (
            jax.lax.psum((mine, extra), axis) if extra.size else (jax.lax.psum(mine, axis), extra)
        )
        error_sq = jnp.zeros((), jnp.float32)
        if rule == "mean":
            mine = mine / n
    else:
        out = compressed_all_reduce(
            mine, axis, codec, rule=rule, residual=None if residual is None else residual[0]
        )
        mine = out.value
        if out.residual is not None:
            new_residual = out.residual[None]
        # A replica's error sums its shares'; with the scalars, one small collective.
        axes = (axis, *inner_axes)  # the scalars are equal on a replica's devices: a part
        parts = (as_varying(extra / inner, axes), as_varying(jnp.square(out.error_norm), axes))
        extra, error_sq = jax.lax.psum(parts, axes)
    extra = extra / n
    if inner_axes:
        mine = jax.lax.all_gather(mine, inner_axes, tiled=True, to="invarying")
    return HierarchicalReduce(mine, new_residual, error_sq / n, extra)


def hierarchical_all_reduce(
    tree: Any,
    axis: str,
    inner_axes: tuple[str, ...],
    *,
    comm_dtype: str | None = None,
    rule: str = "mean",
    residual: jax.Array | None = None,
    extra: jax.Array | None = None,
    inner_manual: bool = False,
) -> HierarchicalReduce:
    """Sum or mean of `tree` over `axis`, each device of a replica reducing one share of it.

    Inside ``jax.shard_map`` with `axis` manual, and `inner_axes` manual too if `inner_manual`
    (module docstring). `tree` (float arrays) varies over `axis` and is equal on the devices of
    a replica.

    Args:
      tree: the replica's pytree.
      axis: the slow mesh axis to reduce over.
      inner_axes: the replica's axes (every other mesh axis), whose devices share the work.
      comm_dtype: a codec name (`xshard.reduce.codecs`) for what crosses `axis`; None or
        ``"float32"``: a plain all-reduce in the leaves' common dtype.
      rule: ``"mean"`` or ``"sum"``.
      residual: the replica's share residuals from the last call, ``(F, share_size)`` float32
        (zeros at first; with `inner_manual` this device's row, ``(1, share_size)``), or None
        for no error feedback.
      extra: float32 scalars (a vector) to average over `axis` alongside; None: none.
      inner_manual: whether `inner_axes` are manual here (inside a ``shard_map`` over them).

    Returns:
      A `HierarchicalReduce`.

    Raises:
      ValueError: for an unknown rule or codec, or a residual of the wrong shape.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}.")
    codec = get_codec(comm_dtype or "float32")
    vec = _flat(tree, axis, inner_axes, codec, residual, rows_manual=inner_manual)
    extra = jnp.zeros((0,), jnp.float32) if extra is None else jnp.asarray(extra, jnp.float32)

    def body(vec: jax.Array, residual: jax.Array | None, extra: jax.Array) -> HierarchicalReduce:
        return reduce_shares(vec, axis, inner_axes, codec, rule, residual, extra)

    if inner_axes and not inner_manual:
        body = jax.shard_map(
            body,
            in_specs=(P(), P(inner_axes), P()),
            out_specs=HierarchicalReduce(P(), P(inner_axes), P(), P()),  # type: ignore[arg-type]
            axis_names=set(inner_axes),
        )
    out = body(vec, residual, extra)
    return out._replace(value=unflatten(out.value, tree))


def _flat(
    tree: Any,
    axis: str,
    inner_axes: tuple[str, ...],
    codec: Codec,
    residual: jax.Array | None,
    *,
    rows_manual: bool,
) -> jax.Array:
    """`tree`'s leaves as one flat vector of ``F * share_size`` (`hierarchical_all_reduce`'s
    arguments), in their common dtype through the identity codec, else float32.

    Raises:
      ValueError: for a residual that is not ``(F, share_size)`` (``(1, share_size)`` with
        `rows_manual`: this device's row).
    """
    n = jax.lax.axis_size(axis)
    mesh = jax.sharding.get_abstract_mesh()
    inner = math.prod(mesh.shape[a] for a in inner_axes)
    share = share_size(tree_size(tree), n, inner, codec)
    rows = 1 if rows_manual else inner
    if residual is not None and residual.shape != (rows, share):
        raise ValueError(
            f"residual must have shape {(rows, share)} (rows, share_size), got {residual.shape}."
        )
    leaves = jax.tree.leaves(tree)
    dtype = jnp.result_type(*leaves) if codec.identity and leaves else jnp.float32
    return flatten(leaves, inner * share, dtype)
