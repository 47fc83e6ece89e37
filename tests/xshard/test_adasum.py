"""xshard.reduce.adasum on 8 simulated CPU devices, mesh (slice, data) = (2, 4): mean of parallel
gradients, sum of orthogonal ones, a NumPy reference of the recursive formula, no NaN for a
zero gradient, the same bits on every replica, power-of-two axes only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tests.cross_shard_helpers import assert_same_on_every_replica, per_replica
from xshard.reduce.adasum import adasum_all_reduce, adasum_tree, check_adasum_axis_size


def _np_pair(a, b):
    dot = float(np.sum(a * b))
    na, nb = float(np.sum(a * a)), float(np.sum(b * b))
    ca = 1 - (dot / (2 * na) if na > 0 else 0)
    cb = 1 - (dot / (2 * nb) if nb > 0 else 0)
    return ca * a + cb * b


def _np_adasum(values):
    """Horovod's recursion over a power-of-two list: neighbours, then pairs of pairs."""
    values = list(values)
    while len(values) > 1:
        values = [_np_pair(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def _groups(stacked, axis):
    """Rows of the (8, ...) stack by group of `axis` on the (2, 4) mesh: a list of index lists."""
    if axis == "slice":
        return [[d, 4 + d] for d in range(4)]
    return [[4 * s + d for d in range(4)] for s in range(2)]


@pytest.mark.parametrize("axis", ("slice", "data"))
def test_matches_numpy_reference_on_random_data(axis):
    k1, k2 = jax.random.split(jax.random.key(0))
    tree = {"w": jax.random.normal(k1, (8, 7, 3)), "b": jax.random.normal(k2, (8, 11))}
    got = per_replica(lambda t: adasum_all_reduce(t, axis), tree)
    for name, leaf in tree.items():
        leaf = np.asarray(leaf, np.float64)
        for group in _groups(leaf, axis):
            want = _np_adasum([leaf[i] for i in group])
            for i in group:
                np.testing.assert_allclose(got[name][i], want, rtol=1e-6, atol=1e-6)
            assert_same_on_every_replica(np.asarray(got[name])[group])


def test_parallel_gradients_give_their_mean():
    g = jax.random.normal(jax.random.key(1), (5, 6))
    scales = jnp.array([1.0, 2.0, 0.5, 4.0, 3.0, 1.0, 0.25, 2.0])  # same direction, any length
    stacked = scales[:, None, None] * g
    got = np.asarray(per_replica(lambda x: adasum_all_reduce(x, "data"), stacked))
    for s in range(2):
        mean = np.mean(np.asarray(stacked[4 * s : 4 * s + 4]), axis=0)
        for d in range(4):
            np.testing.assert_allclose(got[4 * s + d], mean, rtol=1e-6, atol=1e-6)


def test_orthogonal_gradients_give_their_sum():
    stacked = 2.0 * jnp.eye(8, 16)  # row i: a distinct basis vector
    got = np.asarray(per_replica(lambda x: adasum_all_reduce(x, "data"), stacked))
    for s in range(2):
        np.testing.assert_array_equal(got[4 * s], np.sum(np.asarray(stacked[4 * s : 4 * s + 4]), 0))


def test_zero_gradient_gives_no_nan():
    g = jax.random.normal(jax.random.key(2), (8, 10))
    stacked = g.at[0].set(0.0).at[1].set(0.0).at[4:].set(0.0)
    got = np.asarray(per_replica(lambda x: adasum_all_reduce(x, "data"), stacked))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[4:], 0.0)  # all zero: zero
    np.testing.assert_allclose(got[0], _np_adasum(np.asarray(stacked[:4])), rtol=1e-6)


@pytest.mark.parametrize("size", [3, 6, 0])
def test_non_power_of_two_is_refused(size):
    with pytest.raises(ValueError, match=rf"reduction.axes.slice.rule: .*power-of-two.*{size}"):
        check_adasum_axis_size(size, "reduction.axes.slice.rule")
    if size:
        with pytest.raises(ValueError, match="power-of-two"):
            adasum_tree(jnp.ones((size, 4)))


def test_non_power_of_two_axis_is_refused_naming_it():
    mesh = jax.make_mesh(
        (2, 3), ("slice", "data"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:6]
    )
    body = jax.shard_map(
        lambda x: adasum_all_reduce(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"axis 'data'.*power-of-two.*got 3"):
        jax.jit(body)(jnp.ones((3, 4)))


@pytest.mark.parametrize("size", [1, 2, 4, 8, 64])
def test_power_of_two_is_accepted(size):
    check_adasum_axis_size(size, "axis 'slice'")
