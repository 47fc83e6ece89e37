"""A reduction over one mesh axis whose traffic is encoded by a codec, with error feedback.

`compressed_all_reduce` runs inside ``jax.shard_map`` with the axis manual. The pytree is
flattened into one float32 vector (its leaves in `jax.tree.leaves` order, cast back at the
end), padded with zeros to ``n * chunk`` elements (``n`` the axis size, ``chunk`` a multiple of
the codec's block size), and reduced in two stages, each crossing the axis in the codec's wire
dtype (its bits, carried as integers of the same width: ``s8``, ``u16``, ``u8`` collectives in
the compiled HLO, which XLA:CPU would otherwise widen for bf16 and f8):

1. *reduce-scatter*: the message (gradient plus residual) is encoded with per-block scales taken
   with ``lax.pmax`` over the axis (the same on every replica), the encoded chunks exchanged
   with ``lax.all_to_all``, and each replica decodes and sums the ``n`` copies of the chunk it
   owns in float32 (divided by ``n`` for ``mean``);
2. *all-gather*: the owner encodes its summed chunk again (its own scales, sent along) and
   ``lax.all_gather`` brings every chunk to every replica, which decodes them.

Every replica decodes the same gathered bytes with the same scales: the result is bitwise
identical everywhere (and invariant over the axis in JAX's type system). Flattening makes it
one collective per stage whatever the number of leaves; a model-sharded leaf is gathered over
the model axes by the flattening (use it for data-parallel axes).

Error feedback: with a `residual`, the message is ``x + residual`` and the new residual is
``message - decode(encode(message))`` of stage 1, so over steps ``sum(sent) + residual_T ==
sum(x)``: what stage 1 drops comes back on later steps. Stage 2's re-encoding of the summed
chunk is not fed back: it adds at most one rounding of the reduced value (for int8, half a
scale of the chunk's block) that is lost, the same on every replica.

The ``float32`` codec is the plain ``lax.psum``/``lax.pmean`` of the leaves (bitwise), with a
residual that stays zero.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from xshard.reduce.codecs import Codec, block_absmax, get_codec

RULES = ("mean", "sum")


class CompressedReduce(NamedTuple):
    """`compressed_all_reduce`'s result.

    Attributes:
      value: the reduced pytree, identical on every replica (invariant over the axis).
      residual: the new error-feedback residual (flat float32, `padded_size` long, varying
        over the axis), or None where none was given.
      error_norm: float32, this replica's stage-1 compression error norm,
        ``|message - decode(encode(message))|`` (varying over the axis).
      bytes_sent: bytes one replica sends over the axis (static; `bytes_sent`).
    """

    value: Any
    residual: jax.Array | None
    error_norm: jax.Array
    bytes_sent: int


def tree_size(tree: Any) -> int:
    """Number of elements in the leaves of `tree` (arrays or shape structs)."""
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree))


def padded_size(size: int, axis_size: int, block_size: int) -> int:
    """`size` rounded up to whole chunks of whole blocks: the flat vector's (and the residual's)
    length."""
    unit = axis_size * block_size
    return max(1, -(-size // unit)) * unit


def bytes_sent(size: int, axis_size: int, codec: Codec) -> int:
    """Bytes one replica sends over an axis of `axis_size` to reduce `size` elements.

    The ``float32`` codec counts a ring all-reduce, ``2 (n - 1) / n`` of the data; a codec
    counts its all-to-all and its all-gather (``n - 1`` chunks each in the wire dtype), the
    scales' ``pmax`` (a ring all-reduce of the float32 scales) and the gathered chunk scales.
    """
    n = axis_size
    if codec.identity:
        return 2 * (n - 1) * size * 4 // n
    total = padded_size(size, n, codec.block_size)
    chunk = total // n
    sent = 2 * (n - 1) * chunk * codec.bits // 8
    if codec.scaled:
        blocks = total // codec.block_size
        sent += 2 * (n - 1) * blocks * 4 // n + (n - 1) * (blocks // n) * 4
    return sent


def flatten(tree: Any, total: int, dtype: Any = jnp.float32) -> jax.Array:
    """The leaves of `tree` as one vector of `total` elements of `dtype` (zero padding)."""
    flat = [jnp.ravel(x).astype(dtype) for x in jax.tree.leaves(tree)]
    vec = jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)
    return jnp.pad(vec, (0, total - vec.shape[0]))


def unflatten(vec: jax.Array, like: Any) -> Any:
    """`flatten`'s inverse: `vec`'s leading elements shaped and typed as `like`'s leaves."""
    leaves, treedef = jax.tree.flatten(like)
    out, start = [], 0
    for x in leaves:
        size = math.prod(x.shape)
        out.append(vec[start : start + size].reshape(x.shape).astype(x.dtype))
        start += size
    return jax.tree.unflatten(treedef, out)


def compressed_all_reduce(
    x: Any,
    axis_name: str,
    codec: str | Codec,
    *,
    rule: str = "mean",
    residual: jax.Array | None = None,
) -> CompressedReduce:
    """Sum or mean of `x` over `axis_name`, what crosses the axis encoded by `codec`.

    Inside ``jax.shard_map`` with `axis_name` manual; `x` (a pytree of float arrays, any
    shapes) varies over the axis. See the module docstring for the two stages, the error
    feedback and what the result's bits are.

    Args:
      x: this replica's pytree.
      axis_name: the mesh axis to reduce over.
      codec: a `xshard.reduce.codecs.Codec` or its name.
      rule: ``"mean"`` or ``"sum"``.
      residual: the error-feedback residual from the last call (flat float32, `padded_size`
        long; zeros at first), or None for no error feedback.

    Returns:
      A `CompressedReduce`.

    Raises:
      ValueError: for an unknown rule or codec, or a residual of the wrong shape.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}.")
    codec = get_codec(codec)
    n = jax.lax.axis_size(axis_name)
    size = tree_size(x)
    total = padded_size(size, n, codec.block_size)
    if residual is not None and residual.shape != (total,):
        raise ValueError(
            f"residual must have shape {(total,)} (padded_size), got {residual.shape}."
        )
    sent = bytes_sent(size, n, codec)
    if codec.identity:  # the plain collective; nothing is lost, the residual stays zero
        op = jax.lax.psum if rule == "sum" else jax.lax.pmean
        zero = jnp.zeros((), jnp.float32)
        return CompressedReduce(op(x, axis_name), residual, zero, sent)
    message = flatten(x, total)
    if residual is not None:
        message = message + residual
    blocks = message.reshape(total // codec.block_size, codec.block_size)
    scales = None
    if codec.scaled:  # one set of scales on every replica
        scales = codec.scales(jax.lax.pmax(block_absmax(blocks), axis_name))
    wire = codec.encode(blocks, scales)
    error = message - codec.decode(wire, scales).reshape(-1)  # what stage 1 drops
    owned = _reduce_scatter(wire, scales, codec, axis_name, n)
    if rule == "mean":
        owned = owned / n
    value = unflatten(_all_gather(owned, codec, axis_name), x)
    norm = jnp.sqrt(jnp.sum(error * error))
    return CompressedReduce(value, None if residual is None else error, norm, sent)


def _reduce_scatter(
    wire: jax.Array, scales: jax.Array | None, codec: Codec, axis_name: str, n: int
) -> jax.Array:
    """Stage 1: every replica's encoded chunk ``i`` to replica ``i``, decoded and summed there
    in float32 (replica order): ``(blocks per chunk, block_size)``."""
    per_chunk = wire.shape[0] // n
    chunks = wire.reshape(n, per_chunk, codec.block_size)
    carried = jax.lax.all_to_all(codec.to_carrier(chunks), axis_name, 0, 0)
    received = codec.from_carrier(carried)
    own_scales = None
    if scales is not None:
        index = jax.lax.axis_index(axis_name)
        own_scales = jax.lax.dynamic_index_in_dim(
            scales.reshape(n, per_chunk), index, keepdims=False
        )
    return jnp.sum(codec.decode(received, own_scales), axis=0)


def _all_gather(owned: jax.Array, codec: Codec, axis_name: str) -> jax.Array:
    """Stage 2: the owned chunk encoded with its own scales, gathered in the wire dtype to every
    replica (invariant over the axis) and decoded: the flat reduced vector."""
    scales = codec.local_scales(owned)
    carried = codec.to_carrier(codec.encode(owned, scales))
    wire = codec.from_carrier(jax.lax.all_gather(carried, axis_name, to="invarying"))
    gathered_scales = None
    if scales is not None:
        gathered_scales = jax.lax.all_gather(scales, axis_name, to="invarying")
    return codec.decode(wire, gathered_scales).reshape(-1)
