"""`benchmarks.axis_traffic` on programs XLA compiled here: each collective is placed on the
mesh axes its replica groups span, with the bytes of the module docstring's model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from benchmarks.axis_traffic import collectives_by_axis, traffic

SHAPE = {"slice": 2, "data": 4}
N = 1024  # float32 elements per device


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, tuple(SHAPE), axis_types=(AxisType.Auto,) * 2)


def compiled_text(mesh, body, out_specs) -> str:
    """The compiled text of `body` on a per-device (N,) float32 shard, in shard_map over the
    whole mesh."""
    x = jnp.ones((8 * N,), jnp.float32)
    fn = jax.shard_map(body, mesh=mesh, in_specs=P(("slice", "data")), out_specs=out_specs)
    return jax.jit(fn).lower(x).compile().as_text()


def big(collectives):
    """The collectives that move the (N,) vector (1 byte an element at least), not a scalar."""
    return [c for c in collectives if c.result_bytes >= N]


@pytest.mark.parametrize(
    ("axes", "spanned", "n"),
    [("slice", ("slice",), 2), ("data", ("data",), 4), (("slice", "data"), ("slice", "data"), 8)],
)
def test_psum_is_placed_on_the_axes_it_reduces_over(mesh, axes, spanned, n):
    body = lambda v: jax.lax.psum(v, axes)
    other = tuple(a for a in SHAPE if a not in spanned)
    text = compiled_text(mesh, body, out_specs=P(other) if other else P())
    (c,) = big(collectives_by_axis(text, SHAPE))
    assert c.op == "all-reduce" and c.axes == spanned and c.group_size == n
    assert c.flat_bytes == pytest.approx(2 * (n - 1) / n * 4 * N)
    if len(spanned) == 2:  # hierarchical: the slow axis carries a quarter of the vector
        assert c.hierarchical_bytes["slice"] == pytest.approx(2 * 1 / 2 * 4 * N / 4)
        assert c.hierarchical_bytes["data"] == pytest.approx(2 * 3 / 4 * 4 * N / 2)
    on_slice = traffic(big(collectives_by_axis(text, SHAPE)), "slice")
    assert (on_slice.flat_bytes > 0) == ("slice" in spanned)


def test_int8_all_gather_over_slice_counts_one_byte_an_element(mesh):
    body = lambda v: jax.lax.all_gather(v.astype(jnp.int8), "slice", tiled=True, to="invarying")
    text = compiled_text(mesh, body, out_specs=P("data"))
    (c,) = big(collectives_by_axis(text, SHAPE))
    assert c.op == "all-gather" and c.axes == ("slice",)
    assert c.dtypes == ("s8",) and c.result_bytes == 2 * N
    assert c.flat_bytes == pytest.approx(N)  # (n - 1) / n of the gathered bytes


def test_a_permute_within_a_slice_never_counts_on_slice(mesh):
    body = lambda v: jax.lax.ppermute(v, "data", [(i, (i + 1) % 4) for i in range(4)])
    text = compiled_text(mesh, body, out_specs=P(("slice", "data")))
    found = big(collectives_by_axis(text, SHAPE))
    assert [c.op for c in found] == ["collective-permute"] and found[0].axes == ("data",)
    assert traffic(found, "slice").flat_bytes == 0
    assert traffic(found, "data").flat_bytes == pytest.approx(4 * N)


def test_an_unknown_replica_group_format_is_an_error_not_a_guess():
    line = "%x = f32[8]{0} all-reduce(%y), replica_groups=mesh['a'=2,'b':(1)4] {'b'}"
    with pytest.raises(ValueError, match="unsupported"):
        collectives_by_axis(line, SHAPE)
