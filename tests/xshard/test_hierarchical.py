"""xshard.reduce.hierarchical on 8 simulated CPU devices, mesh (slice, data) = (2, 4): each device
of a slice reduces its share over `slice`, then the shares are gathered over `data`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.axis_traffic import collectives_by_axis
from tests.cross_shard_helpers import make_slice_mesh
from xshard.reduce.hierarchical import (
    all_reduce_bytes_per_axis,
    hierarchical_all_reduce,
    share_size,
    slow_bytes_sent,
)

SHAPES = {"w": (37, 5), "b": (11,)}  # 196 elements: shares of 49, not a multiple of anything
SIZE = sum(int(np.prod(s)) for s in SHAPES.values())


@pytest.fixture(scope="module")
def mesh():
    return make_slice_mesh()


def _replicas(seed, integer=False, scale=1.0):
    """A tree per slice (a leading dimension of 2): integers in [-63, 63] or normal floats."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        key = jax.random.key(seed * 10 + i)
        if integer:
            out[name] = jax.random.randint(key, (2, *shape), -63, 64).astype(jnp.float32)
        else:
            out[name] = scale * jax.random.normal(key, (2, *shape))
    return out


def _reduce(mesh, tree, *, inner_axes=("data",), residual=None, **kw):
    """`hierarchical_all_reduce` of `tree`'s slice rows over `slice`, the drift-like scalar
    ``sum(x**2)`` alongside; returns (value, residual, error_sq, extra) and the compiled HLO."""

    def one(tree, residual):
        mine = jax.tree.map(lambda x: x[0], tree)
        extra = jnp.stack([sum(jnp.sum(x * x) for x in jax.tree.leaves(mine))])
        res = None if residual is None else residual[0]
        out = hierarchical_all_reduce(mine, "slice", inner_axes, residual=res, extra=extra, **kw)
        back = None if out.residual is None else out.residual[None]
        return out.value, back, out.error_sq, out.extra

    fn = jax.jit(
        jax.shard_map(
            one,
            mesh=mesh,
            in_specs=(P("slice"), P("slice")),
            out_specs=(P(), P("slice"), P(), P()),
            axis_names={"slice"},
        )
    )
    with jax.set_mesh(mesh):
        tree = jax.device_put(tree, NamedSharding(mesh, P("slice")))
        if residual is not None:
            residual = jax.device_put(residual, NamedSharding(mesh, P("slice", inner_axes)))
        out = fn(tree, residual)
        return out, fn.lower(tree, residual).compile().as_text()


def _each_device(tree):
    """The leaves of `tree` as every device holds them (its addressable shards)."""
    return [np.asarray(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def test_float32_mean_is_exact_and_the_same_on_every_device(mesh):
    x = _replicas(0, integer=True)
    (value, residual, error_sq, extra), _ = _reduce(mesh, x)
    for name in SHAPES:
        want = (np.asarray(x[name][0]) + np.asarray(x[name][1])) / 2
        np.testing.assert_array_equal(np.asarray(value[name]), want)
        shards = [np.asarray(s.data) for s in value[name].addressable_shards]
        assert len(shards) == 8 and all(np.array_equal(s, shards[0]) for s in shards)
    assert residual is None and float(error_sq) == 0.0
    sq = [sum(float(np.sum(np.asarray(v[i]) ** 2)) for v in x.values()) for i in (0, 1)]
    assert float(extra[0]) == pytest.approx((sq[0] + sq[1]) / 2, rel=1e-6)


def test_sum_rule_and_no_inner_axes_agree(mesh):
    x = _replicas(1, integer=True)
    (shared, *_), _ = _reduce(mesh, x, rule="sum")
    (whole, *_), _ = _reduce(mesh, x, rule="sum", inner_axes=())
    for name in SHAPES:
        want = np.asarray(x[name][0]) + np.asarray(x[name][1])
        np.testing.assert_array_equal(np.asarray(shared[name]), want)
        np.testing.assert_array_equal(np.asarray(whole[name]), want)


def test_slice_carries_one_share_per_device_in_one_all_reduce(mesh):
    _, hlo = _reduce(mesh, _replicas(2))
    found = collectives_by_axis(hlo, dict(mesh.shape))
    over_slice = [c for c in found if "slice" in c.axes]
    assert [(c.op, c.axes) for c in over_slice] == [("all-reduce", ("slice",))]
    share = share_size(SIZE, 2, 4, "float32")
    assert share == -(-SIZE // 4)
    assert over_slice[0].result_bytes == 4 * (share + 1)  # the share and the scalar
    assert over_slice[0].flat_bytes == pytest.approx(slow_bytes_sent(SIZE, 2, 4, "float32"), abs=4)
    gathers = [c for c in found if c.axes == ("data",)]
    assert [c.op for c in gathers] == ["all-gather"] and gathers[0].result_bytes == 4 * 4 * share
    # Without the replica's devices sharing it, each sends all of it: four times the bytes.
    _, whole = _reduce(mesh, _replicas(2), inner_axes=())
    alone = [c for c in collectives_by_axis(whole, dict(mesh.shape)) if "slice" in c.axes]
    assert alone[0].result_bytes == 4 * (SIZE + 1)


def test_int8_shares_are_exact_on_small_integers_and_the_wire_is_int8(mesh):
    x = _replicas(3, integer=True)
    (value, _, error_sq, _), hlo = _reduce(mesh, x, rule="sum", comm_dtype="int8")
    for name in SHAPES:  # |sum| <= 126: int8 with a scale of 1 holds it exactly
        want = np.asarray(x[name][0]) + np.asarray(x[name][1])
        np.testing.assert_array_equal(np.asarray(value[name]), want)
    assert float(error_sq) == 0.0
    found = collectives_by_axis(hlo, dict(mesh.shape))
    ops = {(c.op, frozenset(c.dtypes)) for c in found if "slice" in c.axes}
    assert {("all-to-all", frozenset({"s8"})), ("all-gather", frozenset({"s8"}))} <= ops
    sent = sum(c.hierarchical_bytes["slice"] for c in found if "slice" in c.axes)
    # The codec's traffic for one share, plus the scalars' all-reduce (8 bytes of result).
    share = share_size(SIZE, 2, 4, "int8")
    assert sent == pytest.approx(slow_bytes_sent(SIZE, 2, 4, "int8") + 8, abs=8), share


def test_error_feedback_keeps_a_residual_per_share_and_pays_back_what_it_dropped(mesh):
    x = _replicas(4, scale=1e-2)
    # One large entry of opposite signs: coarse int8 scales in its block for what the replicas
    # send (stage 1, fed back), fine ones for their mean (stage 2, which is not).
    x["w"] = x["w"].at[0, 0, 0].set(3.0).at[1, 0, 0].set(-3.0)
    share = share_size(SIZE, 2, 4, "int8")
    true = {k: (np.asarray(v[0]) + np.asarray(v[1])) / 2 for k, v in x.items()}
    residual = jnp.zeros((2, 4, share), jnp.float32)
    total = {k: np.zeros(v.shape[1:], np.float64) for k, v in x.items()}
    steps = 16
    for _ in range(steps):
        (value, residual, error_sq, _), _ = _reduce(mesh, x, comm_dtype="int8", residual=residual)
        total = {k: total[k] + np.asarray(value[k]) for k in total}
    assert residual.shape == (2, 4, share)
    assert float(error_sq) > 0 and float(jnp.abs(residual).max()) > 0
    (plain, none, _, _), _ = _reduce(mesh, x, comm_dtype="int8")
    assert none is None
    ef_err = max(float(np.abs(total[k] / steps - true[k]).max()) for k in SHAPES)
    plain_err = max(float(np.abs(np.asarray(plain[k]) - true[k]).max()) for k in SHAPES)
    assert plain_err > 0
    assert ef_err < plain_err / 4, (ef_err, plain_err)


def test_bad_rule_and_residual_shape_are_refused(mesh):
    with pytest.raises(ValueError, match="rule must be one of"):
        _reduce(mesh, _replicas(5), rule="max")
    with pytest.raises(ValueError, match=r"residual must have shape \(4, "):
        _reduce(mesh, _replicas(5), comm_dtype="int8", residual=jnp.zeros((2, 4, 3)))


def test_a_model_sharded_leaf_on_a_three_axis_mesh_reduces_exactly():
    """Mesh (slice 2, data 2, model 2): a leaf sharded over 'model' within each replica is
    gathered by the flattening and shared out over both inner axes (F = 4)."""
    from jax.sharding import AxisType, Mesh

    mesh = Mesh(
        np.array(jax.devices()[:8]).reshape(2, 2, 2),
        ("slice", "data", "model"),
        axis_types=(AxisType.Auto,) * 3,
    )
    keys = jax.random.split(jax.random.key(6))
    x = {  # integers: the mean of two is exact
        "w": jax.random.randint(keys[0], (2, 6, 8), -63, 64).astype(jnp.float32),
        "b": jax.random.randint(keys[1], (2, 11), -63, 64).astype(jnp.float32),
    }
    size = 6 * 8 + 11
    inner = ("data", "model")

    def one(tree):
        mine = jax.tree.map(lambda v: v[0], tree)
        return hierarchical_all_reduce(mine, "slice", inner).value

    fn = jax.jit(
        jax.shard_map(one, mesh=mesh, in_specs=P("slice"), out_specs=P(), axis_names={"slice"})
    )
    with jax.set_mesh(mesh):
        sharded = {
            "w": jax.device_put(x["w"], NamedSharding(mesh, P("slice", None, "model"))),
            "b": jax.device_put(x["b"], NamedSharding(mesh, P("slice"))),
        }
        value = fn(sharded)
        hlo = fn.lower(sharded).compile().as_text()
    for name in x:
        want = (np.asarray(x[name][0]) + np.asarray(x[name][1])) / 2
        np.testing.assert_array_equal(np.asarray(value[name]), want)
    over_slice = [c for c in collectives_by_axis(hlo, dict(mesh.shape)) if "slice" in c.axes]
    assert [(c.op, c.axes) for c in over_slice] == [("all-reduce", ("slice",))]
    assert over_slice[0].result_bytes == 4 * share_size(size, 2, 4, "float32")


def test_a_synchronous_mean_sends_a_ring_per_axis_the_outer_ones_a_share():
    """`all_reduce_bytes_per_axis`, the traffic logged for the axes a mean reduces every step:
    the inner axis a ring over the whole value, an outer one over what its inner axes leave."""
    per_param = 2 * 3 * 4 // 4  # a ring of 4 sends 2 * 3/4 of the value, 4 bytes a parameter
    assert all_reduce_bytes_per_axis([("slice", 2), ("data", 4)], SIZE) == {
        "slice": slow_bytes_sent(SIZE, 2, 4, "float32"),  # a quarter of the value, over 2
        "data": per_param * SIZE,
    }
    assert slow_bytes_sent(SIZE, 2, 4, "float32") == 4 * -(-SIZE // 4)
    assert all_reduce_bytes_per_axis([("model", 1), ("data", 8)], SIZE) == {"data": 7 * SIZE}
    assert all_reduce_bytes_per_axis([("data", 8)], SIZE, itemsize=2) == {"data": 7 * SIZE // 2}
    assert all_reduce_bytes_per_axis([("data", 1)], SIZE) == {}
