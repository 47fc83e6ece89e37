"""xshard.cross_shard on 8 simulated CPU devices: reduction semantics, guards and slots."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import xshard
from xshard import Reduction

N = 8


def make_mesh(shape=(N,), names=("data",)):
    size = int(np.prod(shape))
    devices = np.array(jax.devices()[:size]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def mse(params, batch):
    pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((pred - batch["y"]) ** 2)


def make_problem(batch_size=32, seed=0):
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    params = {"w": 0.1 * jax.random.normal(kw, (4, 3)), "b": jnp.zeros(3)}
    batch = {
        "x": jax.random.normal(kx, (batch_size, 4)),
        "y": jax.random.normal(ky, (batch_size, 3)),
    }
    return params, batch


def sharded_step(tx, mesh, axes=("data",), loss_fn=mse, batch_spec=None):
    """A jitted shard_map step with per-shard gradients, returning (params, state, grads)."""

    def step(params, state, batch):
        local = jax.lax.pcast(params, axes, to="varying")
        grads = jax.grad(loss_fn)(local, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    batch_spec = P("data") if batch_spec is None else batch_spec
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), batch_spec), out_specs=(P(), P()))
    )


def reduced_grads(reduction, grads_fn, mesh, axes=("data",), **kwargs):
    """Runs `grads_fn(shard_index)` on every shard and returns what cross_shard hands inner."""
    tx = xshard.cross_shard(optax.sgd(1.0), reduction, axis_name=axes, **kwargs)

    def body(_):
        idx = jax.lax.axis_index(axes)
        grads = grads_fn(idx)
        updates, _ = tx.update(grads, tx.init(jax.tree.map(jnp.zeros_like, grads)))
        return jax.tree.map(lambda u: -u, updates)  # sgd(1): update = -grad

    spec = P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P()))(
        jnp.zeros(mesh.size)
    )


def assert_trees_close(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


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
    with pytest.raises(ValueError, match="need per-shard gradients"):
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


# ------------------------------------------------------------------------------ options


def test_none_gradient_leaves_pass_through_unreduced():
    tx = xshard.cross_shard(optax.sgd(1.0), "sum")
    seen = {}

    def body(x):
        grads = {"a": x.reshape(()), "frozen": None}
        updates, _ = tx.update(grads, tx.init({"a": x.reshape(()), "frozen": None}))
        seen["frozen"] = updates["frozen"]
        return -updates["a"].reshape(1)

    out = jax.jit(jax.shard_map(body, mesh=make_mesh(), in_specs=P("data"), out_specs=P()))(
        jnp.arange(8.0)
    )
    assert seen["frozen"] is None
    np.testing.assert_allclose(out, [28.0])


def test_clip_per_shard_clips_each_shard_before_the_mean():
    big = 1000.0

    def grads(i):  # shard 0 has a huge gradient, the others norm 1
        return {"w": jnp.where(i == 0, big, 1.0) * jnp.array([1.0, 0.0])}

    mesh = make_mesh()
    clipped = reduced_grads("mean", grads, mesh, clip_per_shard=2.0)
    unclipped = reduced_grads("mean", grads, mesh)
    np.testing.assert_allclose(clipped["w"], [(2.0 + 7 * 1.0) / 8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(unclipped["w"], [(big + 7.0) / 8, 0.0], rtol=1e-6)


def test_shard_weight_gives_exact_weighted_mean():
    tx = xshard.cross_shard(optax.sgd(1.0), "mean")
    weights = jnp.arange(1.0, 9.0)  # e.g. tokens per shard
    values = jnp.arange(8.0) * 3.0

    def body(w, v):
        g = {"v": v.reshape(())}
        updates, _ = tx.update(g, tx.init(g), shard_weight=w.reshape(()))
        return -updates["v"].reshape(1)

    out = jax.jit(
        jax.shard_map(body, mesh=make_mesh(), in_specs=(P("data"), P("data")), out_specs=P())
    )(weights, values)
    np.testing.assert_allclose(out, [np.sum(weights * values) / np.sum(weights)], rtol=1e-6)


def test_comm_dtype_runs_the_collective_in_bfloat16_and_casts_back():
    tx = xshard.cross_shard(optax.sgd(1.0), "mean", comm_dtype="bfloat16")

    def body(x):
        g = {"v": x.reshape(()) / 3.0}
        updates, _ = tx.update(g, tx.init(g))
        return -updates["v"].reshape(1)

    f = jax.jit(jax.shard_map(body, mesh=make_mesh(), in_specs=P("data"), out_specs=P()))
    x = jnp.arange(8.0)
    out = f(x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, [np.mean(np.arange(8.0) / 3.0)], rtol=1e-2)
    # The program asks for a bf16 all-reduce (XLA:CPU may promote it; accelerators do not).
    stablehlo = f.lower(x).as_text()
    reduce_op = stablehlo[stablehlo.index("stablehlo.all_reduce") :]
    assert "(tensor<bf16>) -> tensor<bf16>" in reduce_op.split("})", 1)[1].splitlines()[0]


def test_nonfinite_on_one_shard_makes_every_shard_skip():
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.adam(0.1), "mean", skip_nonfinite=True)
    step = sharded_step(tx, make_mesh())
    state = tx.init(params)
    params, state = step(params, state, batch)  # one finite step so adam's state is non-trivial
    bad = dict(batch, x=batch["x"].at[5, 0].set(jnp.nan))  # row 5 lives on shard 1 only
    new_params, new_state = step(params, state, bad)
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    jax.tree.map(
        np.testing.assert_array_equal, xshard.inner_state(new_state), xshard.inner_state(state)
    )
    assert int(new_state.skipped_steps) == 1 and int(new_state.consecutive_skipped) == 1
    new_params, new_state = step(new_params, new_state, bad)
    assert int(new_state.skipped_steps) == 2 and int(new_state.consecutive_skipped) == 2
    final_params, final_state = step(new_params, new_state, batch)
    assert int(final_state.skipped_steps) == 2 and int(final_state.consecutive_skipped) == 0
    assert not np.array_equal(final_params["w"], params["w"])


def test_extra_args_are_forwarded_to_the_inner_transform():
    def scale_by_extra():
        def update(updates, state, params=None, *, factor=1.0, **_):
            return jax.tree.map(lambda u: u * factor, updates), state

        return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)

    tx = xshard.cross_shard(scale_by_extra(), "mean", num_shards=1)
    g = {"w": jnp.ones(2)}
    updates, _ = tx.update(g, tx.init(g), factor=3.0)
    np.testing.assert_array_equal(updates["w"], 3.0 * np.ones(2))


def test_inject_hyperparams_learning_rate_stays_readable():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = xshard.cross_shard(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), "mean")
    params, batch = make_problem()
    step = sharded_step(tx, make_mesh())
    state = tx.init(params)
    for _ in range(3):
        params, state = step(params, state, batch)
    lr = xshard.get_hyperparams(state)["learning_rate"]
    np.testing.assert_allclose(lr, schedule(2), rtol=1e-6)  # the rate used at the third step


# -------------------------------------------------------------------------------- slots


def test_adam_slots_match_params_structure():
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.adam(0.1), "mean")
    _, state = sharded_step(tx, make_mesh())(params, tx.init(params), batch)
    assert xshard.get_slot_names(state) == ["mu", "nu"]
    mu = xshard.get_slot(state, "mu")
    assert jax.tree.structure(mu) == jax.tree.structure(params)
    assert_trees_close(
        mu, jax.tree.map(lambda g: 0.1 * g, jax.grad(mse)(params, batch)), rtol=1e-5, atol=1e-7
    )
    assert xshard.get_slot(state, "no_such_slot") is None


def test_momentum_slot_and_wrapped_inner_states():
    params, _ = make_problem()
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
    )
    state = xshard.cross_shard(inner, "mean").init(params)
    assert xshard.get_slot_names(state) == ["trace"]
    assert jax.tree.structure(xshard.get_slot(state, "trace")) == jax.tree.structure(params)
    assert xshard.get_slot_names(xshard.cross_shard(optax.sgd(0.1), "mean").init(params)) == []


def test_inner_state_finds_the_wrapper_inside_a_chain():
    params, _ = make_problem()
    state = optax.chain(optax.identity(), xshard.cross_shard(optax.adam(0.1))).init(params)
    assert xshard.get_slot_names(state) == ["mu", "nu"]
    with pytest.raises(ValueError, match="No cross_shard state"):
        xshard.inner_state(optax.adam(0.1).init(params))


def test_state_records_the_reduced_gradient_summary():
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.sgd(0.1), "mean")
    _, state = sharded_step(tx, make_mesh())(params, tx.init(params), batch)
    grads = jax.grad(mse)(params, batch)
    np.testing.assert_allclose(state.reduced.norm, optax.tree.norm(grads), rtol=1e-5)
    max_abs = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(state.reduced.max_abs, max_abs, rtol=1e-5)
    assert int(state.reduced.nonfinite) == 0


def test_guard_without_stats_still_counts_nonfinite_values():
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", skip_nonfinite=True, track_stats=False)
    bad = dict(batch, x=batch["x"].at[5, 0].set(jnp.inf))
    new_params, state = sharded_step(tx, make_mesh())(params, tx.init(params), bad)
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    assert int(state.reduced.nonfinite) > 0 and int(state.skipped_steps) == 1
    assert float(state.reduced.norm) == 0.0  # not tracked
