"""Collectives over a whole pytree at once: one reduce-scatter or all-gather per dtype.

A ZeRO step reduce-scatters every gradient leaf and all-gathers every parameter. Issued leaf by
leaf that is one collective per parameter (100 of each on an 8-layer GPT). XLA's GPU and TPU
pipelines combine such collectives; XLA:CPU combines only all-reduces. These functions pack the
leaves of one dtype into one buffer, laid out so that row ``i`` holds shard ``i``'s slice of
every leaf, and issue one collective per dtype.

Packing costs a copy: the packed buffer is as large as the leaves it holds. So it is done only
where the compiler would not combine the collectives itself (`packs_by_default`: the CPU
backend); on GPU and TPU the per-leaf collectives are left to XLA's combiners, which merge them
into one variadic collective without copying. ``pack=True`` or ``False`` overrides the rule.

Both run inside ``jax.shard_map`` with `axis_name` manual. A leaf's slice is taken along its
own dimension (``dims``, a tree like the leaves of ints or None), in the order of the axes, as
``psum_scatter(..., tiled=True)`` and ``PartitionSpec(axis_name)`` on that dimension slice it:
the packing changes no value, only how many collectives carry them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

AxisNames = str | tuple[str, ...]


def _is_none(x: Any) -> bool:
    return x is None


def _num_shards(axis_name: AxisNames) -> int:
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _by_dtype(leaves: list[Any], dims: list[int | None]) -> dict[Any, list[int]]:
    """Indices of the leaves with a dimension, grouped by dtype (first-seen order)."""
    groups: dict[Any, list[int]] = {}
    for i, (x, dim) in enumerate(zip(leaves, dims)):
        if x is not None and dim is not None:
            groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    return groups


#: Backends whose XLA compiler does not combine reduce-scatters and all-gathers (XLA's GPU and
#: TPU pipelines run combiner passes; the CPU pipeline only combines all-reduces).
UNCOMBINED_BACKENDS = frozenset({"cpu"})


def packs_by_default() -> bool:
    """Whether `psum_scatter_tree` and `all_gather_tree` pack by default: on a backend in
    `UNCOMBINED_BACKENDS` (the default backend's platform)."""
    return jax.default_backend() in UNCOMBINED_BACKENDS


def _packed(
    tree: Any,
    dims: Any,
    one: Callable[[jax.Array, int], jax.Array],
    many: Callable[[list[jax.Array], list[int]], list[jax.Array]],
    pack: bool | None,
) -> Any:
    """`tree` with its leaves of each dtype passed through `many` together (`one` when alone or
    when not packing); leaves whose dim is None (and None leaves) unchanged."""
    pack = packs_by_default() if pack is None else pack
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_none)
    dim_leaves = treedef.flatten_up_to(dims)  # type: ignore[attr-defined]  # jaxlib: no stubs
    out = list(leaves)
    for idx in _by_dtype(leaves, dim_leaves).values():
        xs, ds = [leaves[i] for i in idx], [dim_leaves[i] for i in idx]
        if pack and len(idx) > 1:
            results = many(xs, ds)
        else:
            results = [one(x, d) for x, d in zip(xs, ds)]
        for i, r in zip(idx, results):
            out[i] = r
    return treedef.unflatten(out)  # type: ignore[attr-defined]  # jaxlib: no stubs


def psum_scatter_tree(
    tree: Any, dims: Any, axis_name: AxisNames, *, pack: bool | None = None
) -> Any:
    """``psum_scatter`` of every leaf along its dimension in `dims`: one collective per dtype.

    Args:
      tree: per-shard arrays (None leaves pass through).
      dims: a tree like `tree`: the dimension to scatter each leaf along (its size divisible by
        the number of shards), or None to ``psum`` it whole.
      axis_name: the manual mesh axis, or axes, to reduce over.
      pack: one collective per dtype (True), one per leaf (False); None: `packs_by_default`.

    Returns:
      A tree like `tree`: the leaves with a dimension hold this shard's slice of the sum (as
      ``jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)``), the others the
      whole sum.
    """
    n = _num_shards(axis_name)

    def one(x, dim):
        return jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)

    def many(xs, ds):
        rows = [jnp.moveaxis(x, d, 0).reshape(n, -1) for x, d in zip(xs, ds)]
        flat = jax.lax.psum_scatter(
            jnp.concatenate(rows, axis=1), axis_name, scatter_dimension=0, tiled=True
        )[0]
        out, start = [], 0
        for x, d, r in zip(xs, ds, rows):
            piece = flat[start : start + r.shape[1]]
            start += r.shape[1]
            moved = (x.shape[d] // n,) + tuple(s for k, s in enumerate(x.shape) if k != d)
            out.append(jnp.moveaxis(piece.reshape(moved), 0, d))
        return out

    scattered = _packed(tree, dims, one, many, pack)
    whole = jax.tree.map(lambda d, x: x if d is None else None, dims, tree, is_leaf=_is_none)
    summed = jax.lax.psum(whole, axis_name)
    return jax.tree.map(
        lambda d, s, w: s if d is not None else w, dims, scattered, summed, is_leaf=_is_none
    )


def all_gather_tree(tree: Any, dims: Any, axis_name: AxisNames, *, pack: bool | None = None) -> Any:
    """``all_gather`` of every leaf along its dimension in `dims`: one collective per dtype.

    The inverse of `psum_scatter_tree`'s slicing: each leaf with a dimension is this shard's
    slice, and comes back whole, the same on every shard (as ``jax.lax.all_gather(x,
    axis_name, axis=dim, tiled=True, to="invarying")``).
    Leaves whose dim is None are returned as they are (already whole on every shard).

    Args:
      tree: per-shard slices (None leaves pass through).
      dims: a tree like `tree` of ints or None.
      axis_name: the manual mesh axis, or axes, to gather over.
      pack: one collective per dtype (True), one per leaf (False); None: `packs_by_default`.
    """
    n = _num_shards(axis_name)

    def one(x, dim):
        return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True, to="invarying")

    def many(xs, ds):
        flats = [jnp.moveaxis(x, d, 0).reshape(-1) for x, d in zip(xs, ds)]
        rows = jax.lax.all_gather(
            jnp.concatenate(flats), axis_name, axis=0, tiled=False, to="invarying"
        )
        out, start = [], 0
        for x, d, f in zip(xs, ds, flats):
            piece = rows[:, start : start + f.shape[0]]
            start += f.shape[0]
            moved = (x.shape[d] * n,) + tuple(s for k, s in enumerate(x.shape) if k != d)
            out.append(jnp.moveaxis(piece.reshape(moved), 0, d))
        return out

    return _packed(tree, dims, one, many, pack)


def _column_major(x: jax.Array) -> jax.Array:
    """`x` flattened for `psum_tree`'s packed buffer: a matrix column by column, any other
    leaf row by row.

    A weight ``W (in, out)`` of ``x @ W`` has the gradient ``x.T @ dy``, which XLA:CPU writes
    as ``dy.T @ x``: ``(out, in)`` row by row, i.e. ``W``'s shape column by column. Packed in
    that order, the gradient is written into the buffer as the dot leaves it; packed row by
    row, XLA transposes the activations first and runs the dot outside its fast (YNNPACK)
    kernels: 12 such dots and transposes on tiny_gpt cost the manual step ~20%
    (docs/benchmarks.md). Only the order of the buffer changes; every sum is the same.
    """
    return (x.T if x.ndim == 2 else x).reshape(-1)


def _from_column_major(flat: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The leaf of `shape` that `_column_major` flattened into `flat`."""
    return flat.reshape(shape[::-1]).T if len(shape) == 2 else flat.reshape(shape)


class Packed(NamedTuple):
    """The result of `psum_tree`: summed buffers, and how to read the tree out of them.

    Attributes:
      parts: the summed buffers, every element of the tree once: one flat buffer per dtype
        where packed, else one per leaf.
      unpack: ``unpack(parts) -> tree``: the leaves sliced (and reshaped) out of `parts`, or
        of buffers computed from them elementwise (e.g. divided by the shard count). Called
        where the leaves are consumed, the slices fuse into the consumers' kernels (e.g.
        inside a ``lax.cond`` branch, which operands would otherwise cross as leaves).
    """

    parts: tuple[jax.Array, ...]
    unpack: Callable[[Sequence[jax.Array]], Any]

    @property
    def tree(self) -> Any:
        """The summed tree, as ``jax.lax.psum(tree, axis_name)`` returns it."""
        return self.unpack(self.parts)


def psum_tree(tree: Any, axis_name: AxisNames, *, pack: bool | None = None) -> Packed:
    """``psum`` of every leaf, the leaves of one dtype packed into one flat buffer
    (`packs_by_default`), matrices column by column (`_column_major`).

    XLA:CPU combines per-leaf all-reduces into one collective itself, but that collective
    carries a tuple of buffers; one packed buffer is faster to reduce across its in-process
    devices, and a reduction over the whole gradient (a norm, a finiteness check) is then one
    kernel over it instead of a few per leaf.

    Args:
      tree: per-shard arrays (None leaves pass through).
      axis_name: the manual mesh axis, or axes, to reduce over.
      pack: pack (True), one psum per leaf (False); None: `packs_by_default`.

    Returns:
      The `Packed` sums: ``.tree`` is ``jax.lax.psum(tree, axis_name)``.
    """
    pack = packs_by_default() if pack is None else pack
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_none)
    groups = list(_by_dtype(leaves, [0] * len(leaves)).values())
    if not pack:
        groups = [[i] for idx in groups for i in idx]
    shapes = [None if x is None else tuple(x.shape) for x in leaves]
    parts = tuple(
        jax.lax.psum(
            leaves[idx[0]]
            if len(idx) == 1
            else jnp.concatenate([_column_major(leaves[i]) for i in idx]),
            axis_name,
        )
        for idx in groups
    )

    def unpack(parts: Sequence[jax.Array]) -> Any:
        out: list[Any] = [None] * len(leaves)
        for idx, part in zip(groups, parts, strict=True):
            if len(idx) == 1:
                out[idx[0]] = part
                continue
            start = 0
            for i in idx:
                shape = shapes[i]
                assert shape is not None  # grouped leaves are never None (`_by_dtype`)
                size = math.prod(shape)
                out[i] = _from_column_major(part[start : start + size], shape)
                start += size
        return treedef.unflatten(out)  # type: ignore[attr-defined]  # jaxlib: no stubs

    return Packed(parts, unpack)
