"""Codecs for what crosses a mesh axis: the wire dtype of a compressed reduction.

A slow mesh axis (the DCN axis ``slice`` of a multi-slice mesh) can carry its reduction in
fewer bits (`xshard.reduce.compressed.compressed_all_reduce`). A `Codec` says how a float32 vector,
cut into blocks of `Codec.block_size` elements, is encoded for the wire and decoded back:

- ``float32``: the identity (the reduction is the plain ``psum``/``pmean``);
- ``bfloat16``: a cast, no scales;
- ``int8``: ``round(x / s)`` clipped to [-127, 127], one scale ``s`` per block;
- ``int4``: ``round(x / s)`` clipped to [-7, 7], one scale per block, two values packed in each
  byte on the wire (4 bits each, two's complement nibbles);
- ``float8_e4m3fn``: ``x / s`` cast to float8 e4m3 (largest finite 448), one scale per block.

Scales are powers of two, the smallest with ``absmax(block) / s <= qmax``: dividing and
multiplying by them is exact, so the only error is the rounding to the wire dtype, and integer
data the wire dtype holds round-trips bitwise. The scales are computed from the block's absmax
*before* any collective: a reduction takes that absmax with ``lax.pmax`` over the axis, so every
replica encodes with the same scales (sums of values encoded with different scales cannot be
added on the wire: collectives and per-replica scales do not commute).

Error bounds per element, for finite ``x`` in a block with absmax ``m``:

- ``bfloat16``: ``|x - decode(encode(x))| <= 2**-8 |x|`` (round to nearest, 8 significant bits);
- ``int8``: ``<= s / 2 < m / 127``; ``int4``: ``<= s / 2 < m / 7``;
- ``float8_e4m3fn``: ``<= 2**-4 |x| + 2**-10 s`` (4 significant bits; 2**-10 s is half the
  spacing of e4m3's subnormals), with ``s < 2 m / 448``.

A non-finite entry makes its block's scale non-finite, so the decoded block is NaN and the
non-finite guard after the reduction sees it. XLA:CPU's collectives carry no 4-bit type, so
``int4`` packs its values in pairs into ``uint8`` before a collective and unpacks them after
(`Codec.to_carrier`): the compiled HLO shows ``u8`` collectives of half as many elements as
``int8``'s ``s8`` ones.

`CODECS` maps each name of `xshard.config.axes.CODEC_NAMES` to its codec (a test checks that
the two name the same codecs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

#: Elements per block sharing one scale (a scale costs 4 bytes: 1/64 of an int8 block).
DEFAULT_BLOCK_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a block of float32 values is sent over an axis.

    Attributes:
      name: its name (one of `xshard.config.axes.CODEC_NAMES`).
      wire_dtype: the dtype that crosses the axis.
      qmax: the largest magnitude a scaled value may take (127 for int8, 448 for e4m3); None:
        no scales, the codec is a cast.
      integer: whether encoding rounds to integers (then clips to ``[-qmax, qmax]``).
      block_size: elements per block sharing a scale.
      packed: wire values per carried byte (2 for 4-bit values, two nibbles a byte; 1: none).
    """

    name: str
    wire_dtype: Any
    qmax: float | None = None
    integer: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    packed: int = 1

    @property
    def identity(self) -> bool:
        """Whether values cross the axis as they are (float32: the plain collective)."""
        return jnp.dtype(self.wire_dtype) == jnp.float32

    @property
    def scaled(self) -> bool:
        """Whether blocks carry a scale."""
        return self.qmax is not None

    @property
    def bits(self) -> int:
        """Bits per element on the wire."""
        return 8 * jnp.dtype(self.wire_dtype).itemsize // self.packed

    def scales(self, absmax: jax.Array) -> jax.Array | None:
        """The power-of-two scales for blocks with these absmax values (None: unscaled).

        Args:
          absmax: float32, per block, the largest magnitude (the same on every replica: take
            it with ``lax.pmax`` over the axis first).

        Returns:
          float32 scales ``s = 2**k``, the smallest with ``absmax <= qmax * s``; 1 for a zero
          block; non-finite for a non-finite absmax.
        """
        if self.qmax is None:
            return None
        absmax = absmax.astype(jnp.float32)
        _, exp = jnp.frexp(absmax / self.qmax)  # absmax / qmax in [2**(exp-1), 2**exp)
        scale = jnp.ldexp(jnp.float32(1), exp - 1)
        # Exact test (qmax * 2**k is exact): one step up where the rounded division fell short.
        scale = jnp.where(absmax <= self.qmax * scale, scale, 2 * scale)
        scale = jnp.where(absmax > 0, scale, jnp.float32(1))
        return jnp.where(jnp.isfinite(absmax), scale, jnp.float32(jnp.nan))

    def local_scales(self, blocks: jax.Array) -> jax.Array | None:
        """`scales` of this replica's own blocks (``(..., block_size)``): for a value only one
        replica encodes (it sends the scales with it)."""
        return self.scales(block_absmax(blocks)) if self.scaled else None

    def encode(self, blocks: jax.Array, scales: jax.Array | None) -> jax.Array:
        """``(..., block_size)`` float32 blocks and their scales -> wire values."""
        x = blocks.astype(jnp.float32)
        if scales is not None:
            x = x / scales[..., None]
        if self.integer:
            assert self.qmax is not None
            x = jnp.clip(jnp.round(x), -self.qmax, self.qmax)
        return x.astype(self.wire_dtype)

    def decode(self, wire: jax.Array, scales: jax.Array | None) -> jax.Array:
        """Wire values and their scales -> float32 blocks."""
        x = wire.astype(jnp.float32)
        return x if scales is None else x * scales[..., None]

    @property
    def carrier_dtype(self) -> Any:
        """The dtype the collectives carry: bytes for packed values; the wire dtype's bits as
        an integer of its width for a float narrower than 32 bits (XLA:CPU widens bf16 and f8
        collectives to f32 and f16; an integer of the same width it leaves alone); else the
        wire dtype."""
        dtype = jnp.dtype(self.wire_dtype)
        if self.packed > 1:
            return jnp.dtype(jnp.uint8)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return jnp.dtype(f"uint{8 * dtype.itemsize}")
        return dtype

    def to_carrier(self, wire: jax.Array) -> jax.Array:
        """Wire values ``(..., block_size)`` as the collectives carry them: a bitcast, or for
        4-bit values pairs packed into bytes (``(..., block_size // 2)``, the first of a pair in
        the low nibble). No value changes."""
        if self.packed == 1:
            return jax.lax.bitcast_convert_type(wire, self.carrier_dtype)
        nibbles = jnp.bitwise_and(wire.astype(jnp.int32), 0xF).astype(jnp.uint8)
        pairs = nibbles.reshape(*wire.shape[:-1], wire.shape[-1] // 2, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    def from_carrier(self, carried: jax.Array) -> jax.Array:
        """`to_carrier`'s inverse."""
        if self.packed == 1:
            return jax.lax.bitcast_convert_type(carried, self.wire_dtype)
        nibbles = jnp.stack([carried & 0xF, carried >> 4], axis=-1).astype(jnp.int8)
        values = jnp.where(nibbles > 7, nibbles - 16, nibbles)  # two's complement
        return values.reshape(*carried.shape[:-1], 2 * carried.shape[-1]).astype(self.wire_dtype)

    def roundtrip(self, blocks: jax.Array, scales: jax.Array | None) -> jax.Array:
        """``decode(encode(blocks))``: what the receivers see of `blocks`."""
        return self.decode(self.encode(blocks, scales), scales)


def block_absmax(blocks: jax.Array) -> jax.Array:
    """float32 max |x| of each block (the last dimension); NaN where a block holds a NaN."""
    return jnp.max(jnp.abs(blocks.astype(jnp.float32)), axis=-1)


#: Each codec by name, at the default block size (`get_codec` for another).
CODECS: dict[str, Codec] = {
    "float32": Codec("float32", jnp.float32),
    "bfloat16": Codec("bfloat16", jnp.bfloat16),
    "int8": Codec("int8", jnp.int8, qmax=127.0, integer=True),
    "int4": Codec("int4", jnp.int8, qmax=7.0, integer=True, packed=2),
    "float8_e4m3fn": Codec("float8_e4m3fn", jnp.float8_e4m3fn, qmax=448.0),
}


def get_codec(name: str | Codec, block_size: int | None = None) -> Codec:
    """The codec called `name` (or `name` itself), with `block_size` if given.

    Raises:
      ValueError: for an unknown name (naming the allowed ones) or a block size < 1.
    """
    codec = name if isinstance(name, Codec) else CODECS.get(name)
    if codec is None:
        raise ValueError(f"Unknown codec {name!r}; allowed: {', '.join(CODECS)}.")
    if block_size is None:
        return codec
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
    if block_size % codec.packed:
        raise ValueError(
            f"block_size of codec {codec.name!r} must be a multiple of {codec.packed} (values "
            f"packed per byte), got {block_size}."
        )
    return dataclasses.replace(codec, block_size=block_size)
