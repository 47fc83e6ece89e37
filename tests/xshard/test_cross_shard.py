"""xshard.cross_shard on 8 simulated CPU devices: reduction semantics and errors."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import xshard
from tests.cross_shard_helpers import (
    N,
    assert_trees_close,
    make_mesh,
    make_problem,
    mse,
    reduced_grads,
    sharded_step,
)
from xshard import Reduction

# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(0.05)], ids=["sgd", "adam"])
def test_mean_over_8_shards_equals_one_device_on_the_full_batch(inner):
    params, batch = make_problem()
    tx = xshard.cross_shard(inner, "mean")
    step = sharded_step(tx, make_mesh())
    p_sharded, s_sharded = params, tx.init(params)
    p_single, s_single = params, inner.init(params)
    for _ in range(4):
        p_sharded, s_sharded = step(p_sharded, s_sharded, batch)
        updates, s_single = inner.update(jax.grad(mse)(p_single, batch), s_single, p_single)
        p_single = optax.apply_updates(p_single, updates)
    assert_trees_close(p_sharded, p_single, rtol=1e-5, atol=1e-6)
    assert_trees_close(xshard.inner_state(s_sharded), s_single, rtol=1e-5, atol=1e-6)


def test_sum_is_8_times_mean():
    def grads(i):
        return {"w": jnp.arange(6.0).reshape(2, 3) * (i + 1.0), "b": jnp.ones(3) * i}

    mesh = make_mesh()
    total = reduced_grads("sum", grads, mesh)
    mean = reduced_grads("mean", grads, mesh)
    assert_trees_close(total, jax.tree.map(lambda m: N * m, mean), rtol=1e-6)
    np.testing.assert_allclose(mean["b"], np.full(3, np.mean(np.arange(N))))


def test_loss_scaled_by_one_over_n_then_summed_equals_mean():
    """TF parity: CrossShardOptimizer scaled the loss by 1/N and used cross_replica_sum."""
    params, batch = make_problem()
    mesh = make_mesh()
    mean_tx = xshard.cross_shard(optax.sgd(0.1), "mean")
    sum_tx = xshard.cross_shard(optax.sgd(0.1), Reduction.SUM)
    p_mean, _ = sharded_step(mean_tx, mesh)(params, mean_tx.init(params), batch)
    p_sum, _ = sharded_step(sum_tx, mesh, loss_fn=lambda p, b: mse(p, b) / N)(
        params, sum_tx.init(params), batch
    )
    assert_trees_close(p_sum, p_mean, rtol=1e-6, atol=1e-7)


def test_reduction_over_two_axes_equals_full_batch():
    params, batch = make_problem()
    mesh = make_mesh((2, 4), ("dcn", "data"))
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", axis_name=("dcn", "data"))
    step = sharded_step(tx, mesh, axes=("dcn", "data"), batch_spec=P(("dcn", "data")))
    p, _ = step(params, tx.init(params), batch)
    expected = optax.apply_updates(
        params, jax.tree.map(lambda g: -0.1 * g, jax.grad(mse)(params, batch))
    )
    assert_trees_close(p, expected, rtol=1e-5, atol=1e-6)


def test_subgroup_reduction_over_data_only_gives_per_replica_group_means():
    mesh = make_mesh((2, 4), ("replica", "data"))
    tx = xshard.cross_shard(optax.sgd(1.0), "mean", axis_name="data")

    def body(x):
        g = {"v": x.reshape(())}  # varying over both axes: shard value = its global index
        updates, _ = tx.update(g, tx.init(g))
        return -updates["v"].reshape(1)

    out = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(("replica", "data")), out_specs=P("replica"))
    )(jnp.arange(8.0))
    np.testing.assert_allclose(out, [np.mean(np.arange(4)), np.mean(np.arange(4, 8))])


def test_one_shard_is_exactly_the_inner_optimizer():
    params, batch = make_problem(batch_size=8)
    inner = optax.adam(0.1)
    tx = xshard.cross_shard(inner, "sum")
    mesh = make_mesh((1,))
    p, s = sharded_step(tx, mesh)(params, tx.init(params), batch)

    def reference(params, state, batch):  # on one shard, grad of replicated params is local
        updates, state = inner.update(jax.grad(mse)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    p_ref, s_ref = jax.jit(
        jax.shard_map(reference, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )(params, inner.init(params), batch)
    jax.tree.map(np.testing.assert_array_equal, p, p_ref)
    jax.tree.map(np.testing.assert_array_equal, xshard.inner_state(s), s_ref)


# ------------------------------------------------------------------------ outside shard_map


def test_gspmd_mean_is_identity_and_sum_scales_by_mesh_axis_size():
    g = {"w": jnp.arange(4.0)}
    mesh = make_mesh((2, 4), ("replica", "data"))
    with jax.set_mesh(mesh):
        mean = jax.jit(lambda g: xshard.reduce_gradients(g, "mean"))(g)
        total = jax.jit(lambda g: xshard.reduce_gradients(g, "sum"))(g)
        both = jax.jit(lambda g: xshard.reduce_gradients(g, "sum", axis_name=("replica", "data")))(
            g
        )
    np.testing.assert_array_equal(mean["w"], g["w"])
    np.testing.assert_array_equal(total["w"], 4 * g["w"])
    np.testing.assert_array_equal(both["w"], 8 * g["w"])


def test_gspmd_sum_with_explicit_num_shards():
    tx = xshard.cross_shard(optax.sgd(1.0), "sum", num_shards=8)
    g = {"w": jnp.ones(2)}
    updates, _ = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_array_equal(updates["w"], -8.0 * np.ones(2))


def test_gspmd_sum_without_mesh_warns_and_assumes_one_shard(caplog):
    tx = xshard.cross_shard(optax.sgd(1.0), "sum")
    g = {"w": jnp.ones(2)}
    with caplog.at_level(logging.WARNING, logger="xshard"):
        updates, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(updates["w"], -np.ones(2))
    assert "assuming 1 shard" in caplog.text


def test_gspmd_axis_not_in_mesh_is_an_error():
    with (
        jax.set_mesh(make_mesh()),
        pytest.raises(ValueError, match=r"'model'.*not an axis of the mesh.*'data'"),
    ):
        xshard.reduce_gradients({"w": jnp.ones(2)}, "sum", axis_name="model")


def test_per_shard_options_outside_shard_map_are_errors():
    with pytest.raises(ValueError, match="needs per-shard gradients"):
        xshard.reduce_gradients({"w": jnp.ones(2)}, "mean", clip_per_shard=1.0)


# ------------------------------------------------------------------------------- errors


def test_gradients_of_replicated_params_raise_the_double_count_error():
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.sgd(0.1), "mean")

    def step(params, state, batch):
        grads = jax.grad(mse)(params, batch)  # no pcast: already summed over `data`
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    f = jax.jit(
        jax.shard_map(step, mesh=make_mesh(), in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    )
    with pytest.raises(xshard.DoubleReductionError, match=r"already invariant.*pcast"):
        f(params, tx.init(params), batch)


@pytest.mark.parametrize("bad", ["avg", "MEANS", None, 2])
def test_unknown_reduction_is_rejected_at_construction(bad):
    with pytest.raises(ValueError, match=r"Unsupported reduction: .*Allowed: 'sum', 'mean'"):
        xshard.cross_shard(optax.sgd(0.1), bad)


@pytest.mark.parametrize("spelling", ["SUM", "Sum", "sum", Reduction.SUM])
def test_reduction_spellings(spelling):
    assert Reduction.parse(spelling) is Reduction.SUM


def test_pmap_without_varying_tracking_reduces_per_device_gradients():
    tx = xshard.cross_shard(optax.sgd(1.0), "mean", axis_name="i")

    def body(x):
        updates, _ = tx.update({"v": x}, tx.init({"v": x}))
        return -updates["v"]

    out = jax.pmap(body, axis_name="i")(jnp.arange(8.0))
    np.testing.assert_allclose(out, np.full(8, 3.5))
