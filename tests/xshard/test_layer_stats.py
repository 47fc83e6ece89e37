"""xshard.stats.layers on 8 simulated CPU devices: statistics of a tensor that every shard holds,
split over the shards, equal those computed whole, and both match NumPy."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xshard.stats.layers import Histograms, leaf_histograms
from xshard.stats.tree import leaf_sq_norms

BINS = 16


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def tree():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 24)).astype(np.float32)
    w[3, 5], w[7, 1] = np.nan, np.inf  # not counted
    return {
        "w": w,  # 384 values: 48 per shard
        "b": rng.normal(size=(5,)).astype(np.float32),  # does not divide by 8: read whole
        "one": np.full((8,), 2.5, np.float32),  # a single value
        "h": rng.normal(size=(4, 6)).astype(np.float16),
    }


def histograms(mesh, shard_axes):
    f = jax.shard_map(
        lambda t: leaf_histograms(t, BINS, shard_axes), mesh=mesh, in_specs=(P(),), out_specs=P()
    )
    return Histograms(np.asarray(jax.jit(f)(tree()).table))


def test_split_over_the_shards_equals_whole_and_numpy(mesh):
    split, whole = histograms(mesh, ("data", "fsdp")), histograms(mesh, None)
    np.testing.assert_array_equal(split.bucket_counts, whole.bucket_counts)
    np.testing.assert_array_equal(split.min, whole.min)
    np.testing.assert_array_equal(split.max, whole.max)
    np.testing.assert_array_equal(split.num, whole.num)
    np.testing.assert_allclose(split.sum, whole.sum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split.sum_squares, whole.sum_squares, rtol=1e-5)
    for row, x in enumerate(jax.tree.leaves(tree())):
        v = np.asarray(x, np.float32).ravel()
        v = v[np.isfinite(v)]
        assert split.num[row] == split.bucket_counts[row].sum() == v.size
        np.testing.assert_allclose(split.sum_squares[row], np.sum(v * v), rtol=1e-5)
        if v.max() > v.min():
            counts, _ = np.histogram(v, bins=BINS, range=(v.min(), v.max()))
            np.testing.assert_array_equal(split.bucket_counts[row], counts)
        else:  # one value: every count in the first bucket
            assert split.bucket_counts[row][0] == v.size


def test_leaf_sums_of_squares_split_over_the_shards_equal_whole(mesh):
    finite = {k: np.nan_to_num(v, posinf=3.0) for k, v in tree().items()}

    def run(axes):
        f = jax.shard_map(
            lambda t: leaf_sq_norms(t, axes), mesh=mesh, in_specs=(P(),), out_specs=P()
        )
        return np.asarray(jax.jit(f)(finite))

    split, whole = run(("data", "fsdp")), run(None)
    want = [np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(finite)]
    np.testing.assert_allclose(split, whole, rtol=1e-6)
    np.testing.assert_allclose(split, want, rtol=1e-5)
