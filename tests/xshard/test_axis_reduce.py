"""cross_shard(..., axes={axis: AxisRule}) on the (slice, data) = (2, 4) mesh: Adasum and
compressed every-step reductions over 'slice', periodic axes left out of the step, the state in
the Trainer (sharding, metrics, checkpoints), and the rules it refuses."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import xshard
from benchmarks.axis_traffic import collectives_by_axis
from tests.cross_shard_helpers import (
    SLICE_AXES,
    assert_same_on_every_replica,
    make_slice_mesh,
)
from tests.xshard.test_adasum import _np_adasum
from trainers.checkpoint.resume import RestoreSource, restore_checkpoint
from trainers.core.trainer import Hook, Trainer
from trainers.tasks.mlp import MLPTask
from xshard.config.axes import AxisRule
from xshard.reduce.codecs import get_codec
from xshard.reduce.compressed import bytes_sent, tree_size
from xshard.reduce.hierarchical import share_size, slow_bytes_sent
from xshard.reduce.per_axis import AxisCommState, state_partition_specs

INT8_EF = AxisRule(comm_dtype="int8", error_feedback=True)


def _grads(seed):
    """Per-replica gradients, a leading dimension of 8."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (8, 40, 7)), "b": jax.random.normal(k2, (8, 13))}


def _params():
    return {"w": jnp.zeros((40, 7)), "b": jnp.zeros(13)}


def run_updates(tx, grads_per_step, mesh=None):
    """``tx.update`` in a shard_map over (slice, data) for each step's per-replica gradients:
    the updates of every replica stacked (8, ...) per step, and the final state."""
    mesh = make_slice_mesh() if mesh is None else mesh
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(_params())
    specs = state_partition_specs(state)

    def body(state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, _params())
        return jax.tree.map(lambda u: u[None], updates), state

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, P(SLICE_AXES)), out_specs=(P(SLICE_AXES), specs)
        )
    )
    out = []
    for grads in grads_per_step:
        updates, state = step(state, grads)
        out.append(jax.block_until_ready(updates))
    return out, state, step


def _slice_means(grads):
    """Per leaf: the mean over 'data' within each slice, (2, ...)."""
    return {k: np.asarray(v, np.float64).reshape(2, 4, -1).mean(1) for k, v in grads.items()}


def test_adasum_over_slice_matches_the_reference_on_every_replica():
    grads = _grads(0)
    adasum = {"slice": AxisRule(rule="adasum")}
    tx = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES, axes=adasum)
    (updates,), _, _ = run_updates(tx, [grads])
    assert_same_on_every_replica(updates)
    for name, means in _slice_means(grads).items():
        want = -_np_adasum([means[0], means[1]])
        np.testing.assert_allclose(updates[name][0].ravel(), want, rtol=1e-5, atol=1e-6)
    mean = {k: np.asarray(v).mean(0) for k, v in grads.items()}
    assert not np.allclose(updates["w"][0], -mean["w"], atol=1e-4)  # not the plain mean


def test_int8_error_feedback_over_slice_is_identical_everywhere_and_close_to_the_mean():
    steps = [_grads(s) for s in range(3)]
    tx = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES, axes={"slice": INT8_EF})
    updates, state, _ = run_updates(tx, steps)
    for grads, upd in zip(steps, updates, strict=True):
        assert_same_on_every_replica(upd)
        for k, v in grads.items():
            exact = -np.asarray(v, np.float64).mean(0)
            peak = max(np.abs(np.asarray(x)).max() for x in grads.values())
            assert np.abs(upd[k][0] - exact).max() <= 3 * peak / 127  # 2 roundings + feedback
    comm = state.comm["slice"]
    assert isinstance(comm, AxisCommState)
    residual = np.asarray(comm.residual)
    size = tree_size(_params())
    # A row per device: each of a slice's 4 devices reduces (and feeds back) its own share.
    assert residual.shape == (2, 4, share_size(size, 2, 4, "int8"))
    assert np.abs(residual).max() > 0
    assert not np.array_equal(residual[0], residual[1])  # one per replica of 'slice'
    assert float(comm.error_norm) > 0
    assert float(comm.bytes_sent) == slow_bytes_sent(size, 2, 4, "int8")


def test_compressed_and_float32_rules_send_one_share_per_device_over_slice():
    """After the mean over 'data' the gradient is the same on a slice's 4 devices: each sends
    a quarter of it over 'slice' (the bytes the compiled step's collectives carry)."""
    big = {"w": jax.random.normal(jax.random.key(7), (8, 64, 96)), "b": jnp.ones((8, 13))}
    params = {"w": jnp.zeros((64, 96)), "b": jnp.zeros(13)}
    size = tree_size(params)
    mesh = make_slice_mesh()
    for rule, codec in ((INT8_EF, "int8"), (AxisRule(comm_dtype="float32"), "float32")):
        tx = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES, axes={"slice": rule})
        with jax.set_mesh(mesh):
            state = jax.jit(tx.init)(params)
        specs = state_partition_specs(state)

        def body(state, grads, tx=tx):
            grads = jax.tree.map(lambda g: g[0], grads)
            updates, state = tx.update(grads, state, params)
            return jax.tree.map(lambda u: u[None], updates), state

        step = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(specs, P(SLICE_AXES)), out_specs=(P(SLICE_AXES), specs)
            )
        )
        hlo = step.lower(state, big).compile().as_text()
        found = collectives_by_axis(hlo, dict(mesh.shape))
        over_slice = sum(c.hierarchical_bytes["slice"] for c in found if "slice" in c.axes)
        want = slow_bytes_sent(size, 2, 4, codec)
        assert want <= over_slice <= want + 64, (codec, over_slice, want)  # + the stats' scalars
        if codec == "int8":  # every device sending all of it would be 4x
            assert over_slice < bytes_sent(size, 2, get_codec("int8")) / 3
            assert float(state.comm["slice"].bytes_sent) == want


def test_float32_rule_is_the_mean_and_sends_plain_floats():
    grads = _grads(1)
    plain = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES)
    ruled = xshard.cross_shard(
        optax.sgd(1.0), axis_name=SLICE_AXES, axes={"slice": AxisRule(comm_dtype="float32")}
    )
    (want,), _, _ = run_updates(plain, [grads])
    (got,), state, _ = run_updates(ruled, [grads])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)
    assert float(state.comm["slice"].error_norm) == 0
    assert isinstance(state.comm["slice"].residual, optax.EmptyState)


def _replica_groups(text):
    return re.findall(r"replica_groups=(\{[{}\d,]*\})", text)


def test_a_periodic_axis_takes_no_part_in_the_step():
    """No collective of the update crosses 'slice': every group lies within one slice (the
    state then varies over 'slice': the periodic sync's business, so only updates come out)."""
    rule = AxisRule(every_steps=4, outer_optimizer=optax.sgd(1.0))
    tx = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES, axes={"slice": rule})
    assert tx.spec.step_axes == ("data",)
    mesh = make_slice_mesh()

    def body(grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, _ = tx.update(grads, tx.init(_params()), _params())
        return jax.tree.map(lambda u: u[None], updates)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(SLICE_AXES), out_specs=P(SLICE_AXES)))
    updates = step(_grads(2))
    means = _slice_means(_grads(2))
    for s in range(2):  # each slice reduced alone, over 'data'
        got = updates["w"][4 * s].ravel()
        np.testing.assert_allclose(got, -means["w"][s], rtol=1e-6, atol=1e-7)
    groups = _replica_groups(step.lower(_grads(2)).compile().as_text())
    assert groups and set(groups) == {"{{0,1,2,3},{4,5,6,7}}"}, groups


def test_axes_none_keeps_todays_state_and_reduction():
    tx = xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES)
    (updates,), state, _ = run_updates(tx, [_grads(3)])
    assert isinstance(state.comm, optax.EmptyState)
    mean = {k: -np.asarray(v).mean(0) for k, v in _grads(3).items()}
    for k, m in mean.items():
        np.testing.assert_allclose(updates[k][0], m, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ({"slice": AxisRule(rule="adasum", comm_dtype="int8")}, "comm_dtype='int8': rule adasum"),
        ({"model": AxisRule(comm_dtype="int8")}, "'model' is not one of"),
        ({"slice": AxisRule(comm_dtype="int3")}, "comm_dtype='int3'"),
        ({"slice": AxisRule(rule="max")}, "rule='max'"),
        ({"slice": "int8"}, "must be an xshard.config.axes.AxisRule"),
        ({"slice": INT8_EF, "data": AxisRule(rule="sum")}, "at most one axis"),
    ],
)
def test_bad_rules_are_refused_naming_the_axis(axes, match):
    with pytest.raises(ValueError, match=match):
        xshard.cross_shard(optax.sgd(1.0), axis_name=SLICE_AXES, axes=axes)


# ----------------------------------------------------------------------------- the trainer


class Recorder(Hook):
    def __init__(self):
        self.metrics = {}

    def on_step(self, step, metrics):
        self.metrics[step] = metrics


TRAINER_ARGS = {"data_axes": SLICE_AXES, "global_batch_size": 32}


def _train(rule, steps=3, **kwargs):
    task = MLPTask()
    tx = xshard.cross_shard(optax.sgd(0.1), axis_name=SLICE_AXES, axes={"slice": rule})
    mesh = make_slice_mesh()
    trainer = Trainer(task, tx, mesh, **TRAINER_ARGS, **kwargs)
    state = trainer.init(trainer.init_params(next(iter(task.batches(32, seed=0)))))
    rec = Recorder()
    result = trainer.fit(state, task.batches(32, seed=0), num_steps=steps, hooks=[rec])
    state, reason = result.state, result.reason
    assert reason == "done"
    return trainer, state, rec


def _assert_replicas_hold_the_same_params(state):
    for leaf in jax.tree.leaves(state.params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


@pytest.fixture(scope="module")
def int8_run():
    return _train(INT8_EF)


def test_trainer_step_with_int8_error_feedback(int8_run):
    trainer, state, rec = int8_run
    _assert_replicas_hold_the_same_params(state)
    residual = state.opt_state.comm["slice"].residual
    assert residual.sharding.spec == P("slice", "data")  # a row per device
    assert np.abs(np.asarray(residual)).max() > 0
    size = tree_size(state.params)
    for step in (1, 2, 3):
        m = rec.metrics[step]
        assert m["comm/slice/bytes_per_step"] == slow_bytes_sent(size, 2, 4, "int8")
        assert m["comm/slice/compression_error_norm"] > 0
        assert np.isfinite(m["train/loss"])


def test_error_feedback_state_survives_a_checkpoint(int8_run, tmp_path):
    from tests.trainers.checkpoint.test_checkpoints import CONFIG, host, save

    trainer, state, _ = int8_run
    save(tmp_path / "ckpt", state)
    task = MLPTask()
    target = trainer.init(trainer.init_params(next(iter(task.batches(32, seed=1)))))
    restored = restore_checkpoint(RestoreSource(tmp_path / "ckpt"), target, CONFIG)
    for key, value in host(state).items():
        np.testing.assert_array_equal(host(restored)[key], value)
    assert restored.opt_state.comm["slice"].residual.sharding.spec == P("slice", "data")


def test_trainer_step_with_adasum_over_slice():
    _, state, rec = _train(AxisRule(rule="adasum"))
    _assert_replicas_hold_the_same_params(state)
    assert rec.metrics[3]["comm/slice/compression_error_norm"] == 0
    assert np.isfinite(rec.metrics[3]["train/loss"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rules_train_under_zero_stages_as_at_stage_0(int8_run, stage):
    """ZeRO slices the optimizer state (and at stage 3 the params) over 'data'; the int8 rule
    over 'slice' still reduces the whole gradient, shared out by its own shares, and the run
    matches stage 0 (the same residuals, the same params to float rounding)."""
    _, want, _ = int8_run
    _, state, rec = _train(INT8_EF, zero_stage=stage)
    residual = state.opt_state.comm["slice"].residual
    assert residual.sharding.spec == P("slice", "data")
    np.testing.assert_allclose(
        np.asarray(residual), np.asarray(want.opt_state.comm["slice"].residual), atol=1e-6
    )
    for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert rec.metrics[3]["comm/slice/compression_error_norm"] > 0
