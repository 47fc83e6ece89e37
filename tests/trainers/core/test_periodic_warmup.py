"""A periodic axis's synchronous warm-up (``warmup_steps``, PyTorch's start_localSGD_iter) in
the real Trainer on 8 simulated CPU devices: during the warm-up a step is the synchronous step
of ``reduction=mean`` (adam included), at the switch the outer params are the replicas',
afterwards the replicas train alone and sync every ``every_steps`` steps."""

import jax
import numpy as np
import optax
import pytest

from benchmarks.axis_traffic import collectives_by_axis, traffic
from tests.trainers.core.test_periodic import BATCH, make, outer_tree
from trainers.core.step import PLAIN
from xshard.config.axes import AxisRule
from xshard.errors import ConfigError
from xshard.reduce.periodic import due_fragment

pytestmark = pytest.mark.slow  # ~20 s of in-process compiles (make test runs them)

WARMUP, EVERY = 3, 4
DILOCO = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _leaves(tree):
    return jax.tree.leaves(jax.device_get(tree))


def test_due_fragment_waits_for_the_warmup():
    rule = AxisRule(every_steps=EVERY, outer_optimizer=DILOCO, warmup_steps=WARMUP)
    assert [t for t in range(1, 16) if due_fragment(t, rule) is not None] == [7, 11, 15]


@pytest.fixture(scope="module")
def task():
    from trainers.tasks.mlp import MLPTask

    return MLPTask()


@pytest.fixture(scope="module")
def mesh():
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, ("slice", "data"), axis_types=(AxisType.Auto,) * 2)


def test_warmup_is_the_synchronous_mean_then_replicas_train_alone(task, mesh):
    inner = optax.adam(1e-2)  # nonlinear: only a synchronous step matches reduction=mean
    mean_trainer, mean_state = make(task, mesh, inner)
    rule = AxisRule(every_steps=EVERY, outer_optimizer=DILOCO, warmup_steps=WARMUP)
    trainer, state = make(task, mesh, inner, periodic=("slice", rule))
    batches = list(zip(range(1, 9), task.batches(BATCH, seed=0), strict=False))
    for step, batch in batches:
        warm = trainer.periodic.in_warmup(step)
        assert warm == (step <= WARMUP)
        state, metrics = trainer.step(state, batch, with_stats=False, warmup=warm)
        state, metrics = trainer.sync(state, step, metrics)
        jax.block_until_ready(state)  # bounded in flight: XLA:CPU collectives
        replicas = _leaves(state.params)
        if warm:
            mean_state, _ = mean_trainer.step(mean_state, batch, with_stats=False)
            for r, m in zip(replicas, _leaves(mean_state.params), strict=True):
                np.testing.assert_array_equal(r[0], r[1])  # the replicas agree bitwise
                np.testing.assert_allclose(r[0], m, rtol=1e-6, atol=1e-7)
        if step == WARMUP:  # the switch: the outer params are the replicas'
            for r, o in zip(replicas, _leaves(outer_tree(trainer, state)), strict=True):
                np.testing.assert_array_equal(r[0], o)
        if WARMUP < step < WARMUP + EVERY:  # alone: no sync yet, each on its own data
            assert "sync/slice/replica_drift" not in metrics
            assert not np.array_equal(replicas[0][0], replicas[0][1])
        if step == WARMUP + EVERY:
            assert metrics["sync/slice/replica_drift"] > 0
            for r, o in zip(replicas, _leaves(outer_tree(trainer, state)), strict=True):
                np.testing.assert_array_equal(r[1], o)
    # The warm-up program reduces over `slice`; the inner program never does.
    shape = dict(mesh.shape)
    warm_hlo = trainer.executable_for(PLAIN, warmup=True).as_text()
    assert traffic(collectives_by_axis(warm_hlo, shape), "slice").ops
    inner_hlo = trainer.executable_for(PLAIN).as_text()
    assert traffic(collectives_by_axis(inner_hlo, shape), "slice").ops == {}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"zero_stage": 1}, "zero_stage"), ({"grad_impl": "gspmd"}, "grad_impl")],
)
def test_warmup_refuses_what_it_cannot_run(task, mesh, kwargs, fragment):
    import xshard
    from trainers.core.trainer import Trainer

    rule = AxisRule(every_steps=EVERY, outer_optimizer=DILOCO, warmup_steps=WARMUP)
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", axis_name=("data",))
    with pytest.raises(ConfigError, match=f"reduction.axes.slice.warmup_steps=3.*{fragment}"):
        Trainer(
            task,
            tx,
            mesh,
            data_axes=("slice", "data"),
            global_batch_size=BATCH,
            periodic=("slice", rule),
            **kwargs,
        )
