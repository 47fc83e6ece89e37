"""xshard.reduce.codecs and xshard.reduce.compressed on 8 simulated CPU devices, mesh (slice, data)
= (2, 4): error bounds, shared scales, exact round trips, the compressed all-reduce and error
feedback."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.cross_shard_helpers import (
    SLICE_AXES,
    assert_same_on_every_replica,
    make_slice_mesh,
    per_replica,
)
from xshard.config.axes import CODEC_NAMES
from xshard.reduce.codecs import CODECS, block_absmax, get_codec
from xshard.reduce.compressed import (
    bytes_sent,
    compressed_all_reduce,
    flatten,
    padded_size,
    tree_size,
)

LOSSY = ("bfloat16", "int8", "int4", "float8_e4m3fn")
# Per codec: the largest integer magnitude it represents exactly (with power-of-two scales).
EXACT_INTEGERS = {"float32": 2**24, "bfloat16": 256, "int8": 127, "int4": 7, "float8_e4m3fn": 16}


def _blocks(seed, shape=(16, 256), scale=3.0):
    x = scale * jax.random.normal(jax.random.key(seed), shape)
    # Blocks of very different magnitudes, and one of zeros.
    return x * jnp.logspace(-3, 2, shape[0])[:, None] * (jnp.arange(shape[0]) != 5)[:, None]


def _bound(name, x, scales):
    """The module docstring's bound per element."""
    x = np.abs(np.asarray(x))
    if name == "float32":
        return np.zeros_like(x)
    if name == "bfloat16":
        return 2.0**-8 * x
    s = np.asarray(scales)[:, None]
    if name in ("int8", "int4"):
        return s / 2 + 0 * x
    return 2.0**-4 * x + 2.0**-10 * s


def test_registry_names_are_the_contracts_codec_names():
    assert tuple(CODECS) == CODEC_NAMES


def test_unknown_codec_and_bad_block_size_are_refused():
    with pytest.raises(ValueError, match="int2.*allowed: float32, bfloat16"):
        get_codec("int2")
    with pytest.raises(ValueError, match="block_size"):
        get_codec("int8", 0)
    with pytest.raises(ValueError, match="block_size of codec 'int4' must be a multiple of 2"):
        get_codec("int4", 63)


def test_int4_packs_two_values_a_byte_and_unpacks_them_bitwise():
    codec = get_codec("int4", block_size=16)
    wire = jnp.array([[*range(-7, 8), -7]], jnp.int8)  # every 4-bit value int4 sends
    carried = codec.to_carrier(wire)
    assert carried.dtype == jnp.uint8 and carried.shape == (1, 8)
    assert int(carried[0, 0]) == (-7 & 0xF) | ((-6 & 0xF) << 4)  # first of a pair: low nibble
    np.testing.assert_array_equal(codec.from_carrier(carried), wire)
    assert codec.bits == 4 and get_codec("int8").bits == 8


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_roundtrip_error_within_documented_bound(name):
    codec = get_codec(name)
    x = _blocks(0)
    scales = codec.local_scales(x)
    err = np.abs(np.asarray(codec.roundtrip(x, scales)) - np.asarray(x))
    assert np.all(err <= _bound(name, x, scales))
    if codec.scaled:  # the smallest power of two with absmax <= qmax * s
        absmax = np.max(np.abs(np.asarray(x)), axis=1)
        s = np.asarray(scales)
        np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
        assert np.all(absmax <= codec.qmax * s)
        live = absmax > 0
        assert np.all(absmax[live] > codec.qmax * s[live] / 2)
        assert s[5] == 1.0  # the zero block


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_integer_data_the_codec_represents_roundtrips_bitwise(name):
    codec = get_codec(name, block_size=64)
    limit = EXACT_INTEGERS[name]
    rng = np.random.default_rng(0)
    x = rng.integers(-limit, limit + 1, size=(8, 64)).astype(np.float32)
    x[3] = np.clip(np.arange(64) - 32, -limit // 2, limit // 2)  # a smaller absmax and scale
    x = jnp.asarray(x)
    np.testing.assert_array_equal(codec.roundtrip(x, codec.local_scales(x)), x)


@pytest.mark.parametrize("name", LOSSY)
def test_nonfinite_entry_makes_its_block_nan(name):
    codec = get_codec(name, block_size=4)
    x = jnp.array([[1.0, jnp.inf, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    out = np.asarray(codec.roundtrip(x, codec.local_scales(x)))
    assert not np.isfinite(out[0]).any() if codec.scaled else not np.isfinite(out[0, 1])
    assert np.isfinite(out[1]).all()


@pytest.mark.parametrize("name", ("int8", "float8_e4m3fn"))
def test_scales_are_identical_on_every_replica(name):
    codec = get_codec(name)
    x = jnp.stack([_blocks(i, scale=i + 1.0) for i in range(8)])

    def scales(blocks):
        return codec.scales(jax.lax.pmax(block_absmax(blocks), "slice"))

    stacked = np.asarray(per_replica(scales, x))
    for d in range(4):  # replicas (0, d) and (1, d) share an axis 'slice' group
        np.testing.assert_array_equal(stacked[d], stacked[4 + d])
    assert not np.array_equal(stacked[0], stacked[1])  # other groups: other data


# ------------------------------------------------------------------- compressed all-reduce


def _tree(i):
    k1, k2 = jax.random.split(jax.random.key(i))
    return {"w": jax.random.normal(k1, (37, 5)), "b": 10 * jax.random.normal(k2, (300,))}


def _stacked_trees():
    return jax.tree.map(lambda *xs: jnp.stack(xs), *[_tree(i) for i in range(8)])


def _group_mean(stacked, rule="mean"):
    """The exact reduction over 'slice' (rows d and 4 + d), per replica."""
    out = {}
    for k, v in stacked.items():
        v = np.asarray(v, np.float64).reshape(2, 4, *v.shape[1:])
        red = v.sum(0) if rule == "sum" else v.mean(0)
        out[k] = np.concatenate([red, red])
    return out


@pytest.mark.parametrize("rule", ("mean", "sum"))
def test_float32_codec_is_the_plain_collective_bitwise(rule):
    trees = _stacked_trees()
    op = jax.lax.pmean if rule == "mean" else jax.lax.psum
    got = per_replica(
        lambda t: compressed_all_reduce(t, "slice", "float32", rule=rule).value, trees
    )
    want = per_replica(lambda t: op(t, "slice"), trees)
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("axis", ("slice", "data"))
def test_result_is_bitwise_identical_on_every_replica(name, axis):
    trees = _stacked_trees()
    got = per_replica(lambda t: compressed_all_reduce(t, axis, name).value, trees)
    for leaf in jax.tree.leaves(got):
        leaf = np.asarray(leaf)
        groups = leaf.reshape(2, 4, -1)
        for g in groups.swapaxes(0, 1) if axis == "slice" else groups:
            assert_same_on_every_replica(g)


@pytest.mark.parametrize("rule", ("mean", "sum"))
def test_int8_is_close_to_the_exact_reduction(rule):
    """Stage 1 and stage 2 each round by at most half a scale, a scale < 2 absmax / 127: per
    element at most max|x| / 127 each (times n for a sum), max over the whole input here
    (the leaves are flattened together: a block may span both)."""
    trees = _stacked_trees()
    got = per_replica(lambda t: compressed_all_reduce(t, "slice", "int8", rule=rule).value, trees)
    want = _group_mean(trees, rule)
    n = 2 if rule == "sum" else 1
    bound = 2.02 * n * max(np.max(np.abs(np.asarray(v))) for v in trees.values()) / 127
    for k in want:
        err = np.abs(np.asarray(got[k], np.float64) - want[k])
        assert 0 < err.max() <= bound


def test_integer_data_reduces_exactly_with_int8():
    x = jnp.asarray(np.random.default_rng(1).integers(-30, 31, (8, 1000)).astype(np.float32))
    got = per_replica(lambda v: compressed_all_reduce(v, "slice", "int8", rule="sum").value, x)
    np.testing.assert_array_equal(got, _group_mean({"x": x}, "sum")["x"])


def _collective_bytes(fn, x):
    """{element type: bytes} of the results of the all-to-all / all-gather / all-reduce ops in
    the compiled HLO of `fn` over the (slice, data) mesh (a tuple result counted whole)."""
    body = jax.shard_map(fn, mesh=make_slice_mesh(), in_specs=P(SLICE_AXES), out_specs=P())
    text = jax.jit(body).lower(x).compile().as_text()
    widths = {"f32": 4, "s8": 1, "u8": 1, "u16": 2}
    out: dict[str, int] = {}
    ops = re.findall(r"=\s*(.+?)\s+(?:all-to-all|all-gather|all-reduce)(?:-start)?\(", text)
    for result in ops:
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            count = int(np.prod([int(d) for d in dims.split(",") if d]))
            out[dtype] = out.get(dtype, 0) + widths[dtype] * count
    return out


@pytest.mark.parametrize(
    ("name", "carrier"),
    [("bfloat16", "u16"), ("int8", "s8"), ("int4", "u8"), ("float8_e4m3fn", "u8")],
)
def test_hlo_carries_the_codec_bits(name, carrier):
    x = jnp.ones((8, 4096))

    def reduce(v):
        out = compressed_all_reduce(v[0], "slice", name).value
        return jax.lax.pmean(out, "data")  # invariant: returned once

    def plain(v):
        return jax.lax.pmean(jax.lax.pmean(v[0], "slice"), "data")

    coded = _collective_bytes(reduce, x)
    base = _collective_bytes(plain, x)
    assert set(coded) - {"f32"} == {carrier}  # the payload; f32 only for scales and 'data'
    # The payload: an all-to-all and an all-gather of 4096 elements each in the codec's bits
    # (int4: two a byte), and nothing wider.
    payload = 2 * 4096 * get_codec(name).bits // 8
    assert payload <= coded[carrier] < 2 * payload
    assert coded["f32"] - base["f32"] <= 4096 * 4 // 32  # scales: a small fraction


def test_bytes_sent_falls_with_the_codec():
    size, n = 10_000, 2
    f32 = bytes_sent(size, n, get_codec("float32"))
    assert f32 == 2 * (n - 1) * size * 4 // n
    ratios = {c: f32 / bytes_sent(size, n, get_codec(c)) for c in LOSSY}
    assert 1.9 < ratios["bfloat16"] <= 2
    assert 3.5 < ratios["int8"] < 4 and 3.5 < ratios["float8_e4m3fn"] < 4
    assert 6.5 < ratios["int4"] < 8  # the scales cost 1/32 of int4's payload


# ----------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", LOSSY)
def test_error_feedback_telescopes(name):
    """Over T steps: sum of what stage 1 sent + the final residual == sum of the messages."""
    steps = 5
    xs = [_stacked_trees() for _ in range(steps)]
    xs = [jax.tree.map(lambda v, t=t: v * (1 + t) + t, x) for t, x in enumerate(xs)]
    codec = get_codec(name, block_size=64)
    total = padded_size(tree_size(_tree(0)), 2, codec.block_size)

    def run(*trees):
        residual = jnp.zeros((total,), jnp.float32)
        sent_sum = jnp.zeros((total,), jnp.float32)
        true_sum = jnp.zeros((total,), jnp.float32)
        for tree in trees:
            message = flatten(tree, total) + residual
            blocks = message.reshape(-1, codec.block_size)
            scales = codec.scales(jax.lax.pmax(block_absmax(blocks), "slice"))
            sent_sum = sent_sum + codec.roundtrip(blocks, scales).reshape(-1)
            true_sum = true_sum + flatten(tree, total)
            out = compressed_all_reduce(tree, "slice", codec, residual=residual)
            residual = out.residual
        return sent_sum + residual, true_sum, residual

    telescoped, true_sum, residual = per_replica(run, *xs)
    np.testing.assert_allclose(telescoped, true_sum, rtol=1e-6, atol=1e-5)
    assert np.abs(np.asarray(residual)).max() > 0  # something was carried


def test_error_feedback_telescopes_bitwise_on_exact_data():
    """Integer messages in power-of-two-scaled int8: every partial sum is exact."""
    rng = np.random.default_rng(2)
    xs = [jnp.asarray(rng.integers(-500, 501, (8, 512)).astype(np.float32)) for _ in range(4)]
    codec = get_codec("int8", block_size=64)

    def run(*vs):
        residual = jnp.zeros((512,), jnp.float32)
        sent = jnp.zeros((512,), jnp.float32)
        for v in vs:
            out = compressed_all_reduce(v, "slice", codec, residual=residual)
            sent = sent + (v + residual - out.residual)  # what stage 1 sent
            residual = out.residual
        return sent + residual, sum(vs)

    telescoped, true_sum = per_replica(run, *xs)
    np.testing.assert_array_equal(telescoped, true_sum)


def test_float32_codec_with_error_feedback_equals_no_codec():
    trees = _stacked_trees()
    total = padded_size(tree_size(_tree(0)), 2, get_codec("float32").block_size)

    def run(t):
        out = compressed_all_reduce(t, "slice", "float32", residual=jnp.zeros((total,)))
        return out.value, out.residual

    value, residual = per_replica(run, trees)
    plain = per_replica(lambda t: jax.lax.pmean(t, "slice"), trees)
    jax.tree.map(np.testing.assert_array_equal, value, plain)
    assert not np.asarray(residual).any()
