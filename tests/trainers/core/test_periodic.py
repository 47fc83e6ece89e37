"""A periodic mesh axis (local SGD, DiLoCo) in the real Trainer on 8 simulated CPU devices:
the semantics issue 25 pins, the two programs' HLO, fragments and the non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import xshard
from benchmarks.axis_traffic import collectives_by_axis, traffic
from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask
from xshard.config.axes import AxisRule
from xshard.reduce.compressed import tree_size
from xshard.reduce.periodic import due_fragment, fragment_leaves

BATCH = 32
AXES = ("slice", "data")


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def task():
    return MLPTask()


def make(task, mesh, inner, *, periodic=None, zero_stage=0):
    axes = AXES if periodic is None else ("data",)
    tx = xshard.cross_shard(inner, "mean", axis_name=axes, skip_nonfinite=True)
    trainer = Trainer(
        task,
        tx,
        mesh,
        data_axes=AXES,
        global_batch_size=BATCH,
        periodic=periodic,
        zero_stage=zero_stage,
    )
    first = next(iter(task.batches(BATCH, seed=0)))
    return trainer, trainer.init(trainer.init_params(first))


def run(trainer, state, steps, on_step=None):
    batches = iter(trainer.task.batches(BATCH, seed=0))
    for step in range(1, steps + 1):
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        state, metrics = trainer.sync(state, step, metrics)
        jax.block_until_ready(state)  # bounded in flight: XLA:CPU collectives
        if on_step is not None:
            on_step(step, state, metrics)
    return state


def outer_tree(trainer, state):
    from trainers.core.periodic import outer_params

    return jax.device_get(outer_params(state))


def averaging(every_steps=1, **kw):
    return ("slice", AxisRule(every_steps=every_steps, outer_optimizer=optax.sgd(1.0), **kw))


@pytest.mark.parametrize(
    "inner",
    [optax.sgd(0.05), optax.sgd(0.05, momentum=0.9)],
    ids=["sgd", "momentum"],
)
def test_local_sgd_every_step_trains_as_the_synchronous_mean(task, mesh, inner):
    """Averaging params after every step of a linear inner optimizer is averaging gradients:
    equal up to float rounding (theta - (theta - mean) is not mean bitwise)."""
    sync_trainer, sync_state = make(task, mesh, inner)
    sync_state = run(sync_trainer, sync_state, 6)
    local_trainer, local_state = make(task, mesh, inner, periodic=averaging())
    local_state = run(local_trainer, local_state, 6)
    want, got = jax.device_get(sync_state.params), outer_tree(local_trainer, local_state)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-6)


def test_local_sgd_every_step_with_adam_differs(task, mesh):
    """Negative control: adam is not linear in the gradient (m / sqrt(v) per replica, then
    averaged, is not the update of the averaged gradient), so per-replica adam steps then
    averaging is not synchronous adam."""
    sync_trainer, sync_state = make(task, mesh, optax.adam(1e-2))
    sync_state = run(sync_trainer, sync_state, 6)
    local_trainer, local_state = make(task, mesh, optax.adam(1e-2), periodic=averaging())
    local_state = run(local_trainer, local_state, 6)
    want, got = jax.device_get(sync_state.params), outer_tree(local_trainer, local_state)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True)
    )
    assert diff > 1e-4


def test_every_h_steps_replicas_hold_the_outer_params_and_between_them_outer_stays(task, mesh):
    trainer, state = make(task, mesh, optax.sgd(0.05), periodic=averaging(every_steps=4))
    seen = {}

    def check(step, state, metrics):
        outer = outer_tree(trainer, state)
        replicas = jax.device_get(state.params)
        if step % 4 == 0:
            for o, r in zip(jax.tree.leaves(outer), jax.tree.leaves(replicas), strict=True):
                np.testing.assert_array_equal(r[0], o)
                np.testing.assert_array_equal(r[1], o)
            assert metrics["sync/slice/replica_drift"] > 0
            assert metrics["sync/slice/skipped"] == 0
        else:
            assert "sync/slice/pseudo_grad_norm" not in metrics
            before = seen.get("outer")
            if before is not None:
                for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(outer), strict=True):
                    np.testing.assert_array_equal(a, b)
            r = jax.tree.leaves(replicas)[0]
            assert not np.array_equal(r[0], r[1])  # each replica trained on its own data
        seen["outer"] = outer

    run(trainer, state, 8, check)


def test_hlo_inner_program_never_crosses_slice_and_the_sync_once(task, mesh):
    trainer, state = make(task, mesh, optax.sgd(0.05), periodic=averaging(every_steps=2))
    state = run(trainer, state, 2)
    shape = dict(mesh.shape)
    inner = collectives_by_axis(trainer.executable_for(0).as_text(), shape)
    assert traffic(inner, "slice").ops == {}
    assert traffic(inner, "data").ops  # it does reduce over data
    sync = collectives_by_axis(trainer.sync_executable(0).as_text(), shape)
    over_slice = [c for c in sync if "slice" in c.axes]
    assert [(c.op, c.axes) for c in over_slice] == [("all-reduce", ("slice",))]
    # Hierarchical: each of a slice's 4 devices reduces its quarter of the pseudo-gradient
    # (the drift scalar rides along), then the quarters are gathered within the slice.
    size = tree_size(outer_tree(trainer, state))
    assert over_slice[0].result_bytes == 4 * (-(-size // 4) + 1)
    assert [(c.op, c.axes) for c in sync if c.axes == ("data",)] == [("all-gather", ("data",))]
    logged = trainer.periodic_programs.bytes_per_step * 2  # every_steps=2
    assert logged == pytest.approx(over_slice[0].flat_bytes, abs=8)


def test_fragments_sync_their_own_leaves_on_their_own_steps(task, mesh):
    rule = AxisRule(every_steps=4, outer_optimizer=optax.sgd(1.0), fragments=2)
    assert [due_fragment(t, rule) for t in range(1, 9)] == [None, 0, None, 1, None, 0, None, 1]
    assert fragment_leaves([10, 10, 10, 10], 2) == ((0, 1), (2, 3))
    trainer, state = make(task, mesh, optax.sgd(0.05), periodic=("slice", rule))
    groups = trainer.periodic_programs.groups
    assert len(groups) == 2

    def check(step, state, metrics):
        leaves = jax.tree.leaves(jax.device_get(state.params))
        synced = {2: 0, 4: 1, 6: 0, 8: 1}.get(step)
        for f, idx in enumerate(groups):
            for i in idx:
                equal = np.array_equal(leaves[i][0], leaves[i][1])
                assert equal == (f == synced), (step, f, i)

    run(trainer, state, 8, check)


def test_nonfinite_pseudo_gradient_skips_the_sync_on_every_replica(task, mesh):
    trainer, state = make(task, mesh, optax.sgd(0.05), periodic=averaging(every_steps=2))
    batches = iter(task.batches(BATCH, seed=0))
    state, metrics = trainer.step(state, next(batches), with_stats=False)
    before = outer_tree(trainer, state)
    outer_opt = jax.device_get(state.outer.opt_state)
    # One replica diverges: a NaN in its params makes the mean pseudo-gradient non-finite.
    poisoned = jax.tree.map(lambda x: x.at[1].set(jnp.nan), state.params)
    state = state._replace(params=poisoned)
    state, metrics = trainer.step(state, next(batches), with_stats=False)
    state, metrics = trainer.sync(state, 2, metrics)
    assert metrics["sync/slice/skipped"] == 1.0
    after = outer_tree(trainer, state)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    jax.tree.map(np.testing.assert_array_equal, outer_opt, jax.device_get(state.outer.opt_state))
    for o, r in zip(jax.tree.leaves(after), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(r[0], o)  # every replica restarts from the kept outer
        np.testing.assert_array_equal(r[1], o)


DILOCO_RULE = (
    "slice",
    AxisRule(every_steps=2, outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True)),
)
ZERO_INNER = optax.sgd(0.05, momentum=0.9)


@pytest.fixture(scope="module")
def stage_0_outer(task, mesh):
    """The outer params after 4 steps (2 syncs) of DiLoCo at ZeRO stage 0."""
    trainer, state = make(task, mesh, ZERO_INNER, periodic=DILOCO_RULE)
    return jax.tree.leaves(outer_tree(trainer, run(trainer, state, 4)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_with_diloco_shard_the_outer_state_and_train_as_stage_0(
    task, mesh, stage, stage_0_outer
):
    trainer, state = make(task, mesh, ZERO_INNER, periodic=DILOCO_RULE, zero_stage=stage)
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(state.outer.opt_state)}
    assert any("data" in s for s in specs), specs  # momentum sharded over data like ZeRO
    state = run(trainer, state, 4)
    outer = jax.tree.leaves(outer_tree(trainer, state))
    for o, r in zip(outer, jax.tree.leaves(jax.device_get(state.params)), strict=True):
        np.testing.assert_array_equal(r[0], o)
        np.testing.assert_array_equal(r[1], o)
    for o, want in zip(outer, stage_0_outer, strict=True):
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
