"""cross_shard options on 8 CPU devices: None leaves, per-shard clip, weights, bf16, the
non-finite guard, extra args, inject_hyperparams; slots and the reduced-gradient summary."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import xshard
from tests.cross_shard_helpers import (
    assert_trees_close,
    make_mesh,
    make_problem,
    mse,
    reduced_grads,
    sharded_step,
)

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
    # The guard's sum of squares gives the norms anyway: of the finite elements here.
    finite = [np.where(np.isfinite(g), g, 0.0) for g in jax.tree.leaves(jax.grad(mse)(params, bad))]
    np.testing.assert_allclose(state.reduced.norm, np.sqrt(sum(np.sum(g**2) for g in finite)), 1e-5)
    assert np.isnan(state.reduced.max_abs)  # a statistic: not tracked


@pytest.mark.parametrize("with_stats", [True, False])
def test_with_stats_false_records_only_what_the_guard_needs(with_stats):
    params, batch = make_problem()
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", skip_nonfinite=True)

    def step(params, state, batch, flag):
        local = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(mse)(local, batch)
        updates, state = tx.update(grads, state, params, with_stats=flag)
        return optax.apply_updates(params, updates), state

    f = jax.jit(
        jax.shard_map(
            step, mesh=make_mesh(), in_specs=(P(), P(), P("data"), P()), out_specs=(P(), P())
        )
    )
    flag = jnp.asarray(with_stats)
    _, state = f(params, tx.init(params), batch, flag)
    grads = jax.grad(mse)(params, batch)
    # The norms come with the guard's sum of squares on every update; max |g| is a statistic.
    np.testing.assert_allclose(state.reduced.norm, optax.tree.norm(grads), rtol=1e-5)
    max_abs = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
    if with_stats:
        np.testing.assert_allclose(state.reduced.max_abs, max_abs, rtol=1e-5)
    else:
        assert np.isnan(state.reduced.max_abs)
    bad = dict(batch, x=batch["x"].at[3, 1].set(jnp.nan))
    new_params, state = f(params, tx.init(params), bad, flag)
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    assert int(state.reduced.nonfinite) > 0 and int(state.skipped_steps) == 1


# ------------------------------------------------------------------------------ its type


def test_cross_shard_is_an_optax_transformation_that_carries_its_spec_and_phases():
    params, _ = make_problem()
    grads = jax.tree.map(jnp.ones_like, params)
    tx = xshard.cross_shard(optax.sgd(0.1), " Sum ", num_shards=2, skip_nonfinite=True)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert isinstance(tx, xshard.CrossShardTransformation) and len(tx) == 2
    assert tx.spec.reduction is xshard.Reduction.SUM and tx.spec.axis_name == ("data",)
    assert tx.spec.skip_nonfinite and tx.spec.num_shards == 2
    assert isinstance(tx.phases, xshard.CrossShardPhases)
    assert optax.with_extra_args_support(tx) is tx  # extra arguments reach it in a chain
    expected, _ = tx.update(grads, tx.init(params), params)
    wrapped = {
        "chain": optax.chain(tx),
        "apply_if_finite": optax.apply_if_finite(tx, 3),
        "partition": optax.partition({"a": tx}, jax.tree.map(lambda _: "a", params)),
    }
    for other in wrapped.values():
        updates, _ = other.update(grads, other.init(params), params)
        assert_trees_close(updates, expected, rtol=0, atol=0)
    # Another update is another transformation; as a pytree it keeps its spec.
    assert type(tx._replace(update=tx.update)) is optax.GradientTransformationExtraArgs
    leaves, treedef = jax.tree.flatten(tx)
    assert jax.tree.unflatten(treedef, leaves).spec is tx.spec


def test_phases_compose_to_the_update():
    params, _ = make_problem()
    grads = jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params)
    tx = xshard.cross_shard(optax.adam(0.1), "sum", num_shards=4)
    state = tx.init(params)
    expected, expected_state = tx.update(grads, state, params)
    local = tx.phases.reduce(grads, params)
    updates, new_state = tx.phases.finish(local, state, params)
    assert_trees_close(updates, expected, rtol=0, atol=0)
    assert_trees_close(new_state.inner_state, expected_state.inner_state, rtol=0, atol=0)
    applied = tx.phases.apply(local, state, params)
    assert_trees_close(applied.params, optax.apply_updates(params, expected), rtol=0, atol=0)
    assert_trees_close(applied.state.inner_state, expected_state.inner_state, rtol=0, atol=0)
    assert applied.measured is None
