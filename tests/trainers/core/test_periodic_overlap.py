"""The overlapped window (``overlap``: a delayed sync's collective and the tau inner steps in
ONE program, `trainers.core.periodic.window`) in the real Trainer on 8 simulated CPU devices:
the same params as the separate programs and as the reference of the equations
(`tests.trainers.core.test_periodic_delay.reference`), and a compiled program whose collective
over ``slice`` and the loop of inner steps do not read each other."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from tests.trainers.core.test_periodic import BATCH, make, outer_tree
from tests.trainers.core.test_periodic_delay import (
    DEVICES,
    EVERY,
    INNER,
    OUTER,
    REPLICAS,
    STEPS,
    reference,
)
from trainers.core.hook import Hook
from trainers.core.periodic.window import independence, overlapped_steps
from trainers.tasks.mlp import MLPTask
from xshard.config.axes import AxisRule, check_rule
from xshard.errors import ConfigError
from xshard.reduce.periodic import due_fragment

pytestmark = pytest.mark.slow  # ~30 s of in-process compiles (make test runs them)


@pytest.fixture(scope="module")
def task():
    return MLPTask(hidden=(32,), activation="tanh")  # test_periodic_delay's


@pytest.fixture(scope="module")
def mesh():
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8]).reshape(REPLICAS, DEVICES)
    return Mesh(devices, ("slice", "data"), axis_types=(AxisType.Auto,) * 2)


def run_overlapped(trainer, state, steps):
    """`steps` updates; after each send step t, steps t + 1 .. t + tau and the outer update
    as one window program when the window ends within `steps`."""
    rule = trainer.periodic.rule
    batches = iter(trainer.task.batches(BATCH, seed=0))
    step = 0
    while step < steps:
        step += 1
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        state, metrics = trainer.sync(state, step, metrics)
        jax.block_until_ready(state)
        if due_fragment(step, rule) is not None and step + rule.sync_delay <= steps:
            window = [next(batches) for _ in range(rule.sync_delay)]
            state, metrics_list = overlapped_steps(trainer, state, step, window)
            jax.block_until_ready(state)
            step += rule.sync_delay
    return state, metrics_list


def slice_groups(mesh):
    """The replica groups of a collective over ``slice`` as the HLO prints them."""
    ids = mesh.devices.T  # one row per data index: its devices over slice
    return "{" + ",".join("{" + ",".join(str(d.id) for d in row) + "}" for row in ids) + "}"


def _rule(tau, alpha, fragments, codec):
    return AxisRule(
        every_steps=EVERY,
        outer_optimizer=optax.sgd(**OUTER),
        fragments=fragments,
        comm_dtype=codec,
        error_feedback=codec is not None,
        sync_delay=tau,
        mix=alpha,
    )


@pytest.mark.parametrize(
    "tau, alpha, fragments, codec",
    [(1, 0.25, 2, "int8"), (3, 1.0, 1, "int8")],  # float32, tau 2: the fit test below
)
def test_the_window_matches_the_reference_and_its_collective_and_loop_are_independent(
    task, mesh, tau, alpha, fragments, codec
):
    """Params to 3e-7 of the reference (bitwise equal to the separate programs, measured:
    docs/reductions.md), and in the compiled window program every collective over ``slice``
    reads neither the loop of inner steps nor is read by it."""
    rule = _rule(tau, alpha, fragments, codec)
    trainer, state = make(task, mesh, INNER, periodic=("slice", rule))
    params = jax.tree.map(lambda x: np.asarray(x[0]), jax.device_get(state.params))
    groups = trainer.periodic_programs.groups
    state, metrics = run_overlapped(trainer, state, STEPS)
    if tau > 1:  # XLA inlines a loop of one trip: no loop to find
        text = trainer.periodic_programs.window_executable(0).as_text()
        found = independence(text, slice_groups(mesh))
        assert found.collectives, "no collective over slice found in the window program"
        assert not found.collective_reads_loop and not found.loop_reads_collective, found
    want_outer, want_replicas = reference(
        params, task.batches(BATCH, seed=0), groups, tau, alpha, codec
    )
    got_outer = jax.tree.leaves(outer_tree(trainer, state))
    got_replicas = jax.tree.leaves(jax.device_get(state.params))
    for i, (o, w) in enumerate(zip(got_outer, want_outer, strict=True)):
        np.testing.assert_allclose(o, w, rtol=0, atol=3e-7, err_msg=f"outer leaf {i}")
    for r in range(REPLICAS):
        for i, (g, w) in enumerate(zip(got_replicas, want_replicas[r], strict=True)):
            np.testing.assert_allclose(g[r], w, rtol=0, atol=3e-7, err_msg=f"replica {r} leaf {i}")


def test_independence_sees_a_collective_that_reads_the_loop(mesh):
    """The reader's negative: a psum over ``slice`` of a ``fori_loop``'s result."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def program(x, y, n):  # a traced trip count: a while loop, not unrolled
        looped = jax.lax.fori_loop(0, n, lambda _, a: jnp.tanh(a), x)
        summed = jax.shard_map(
            lambda a: jax.lax.psum(a, "slice"), mesh=mesh, in_specs=P("slice"), out_specs=P()
        )
        return summed(looped), summed(y)

    x = jax.device_put(np.ones((2, 8), np.float32), NamedSharding(mesh, P("slice")))
    text = jax.jit(program).lower(x, x, 3).compile().as_text()
    found = independence(text, slice_groups(mesh))
    assert len(found.collectives) >= 1
    assert found.collective_reads_loop
    assert not found.loop_reads_collective


class _Steps(Hook):
    """Records the steps whose metrics it was given, and the sync statistics' steps."""

    def __init__(self):
        self.steps, self.synced = [], []

    def on_step(self, step, metrics):
        self.steps.append(step)
        if "sync/slice/pseudo_grad_norm" in metrics:
            self.synced.append(step)


def test_fit_with_overlap_trains_as_the_separate_programs(task, mesh):
    """``overlap=True`` in `Trainer.fit`: the windows after steps 4 and 8 (tau 2) run as one
    program each; the state equals the separate programs' bitwise, every step's metrics
    reach the hooks in order, the sync statistics at the outer update's step."""
    states, hooks = [], []
    for overlap in (False, True):
        rule = dataclasses.replace(_rule(2, 0.5, 1, None), overlap=overlap)
        trainer, state = make(task, mesh, INNER, periodic=("slice", rule))
        hook = _Steps()
        batches = task.batches(BATCH, seed=0)
        result = trainer.fit(state, batches, num_steps=STEPS, hooks=[hook], stats_every=0)
        window = trainer.periodic_programs.window_executable(0)
        assert (window is not None) == overlap
        if overlap:
            found = independence(window.as_text(), slice_groups(mesh))
            assert found.collectives and not found.collective_reads_loop, found
            assert not found.loop_reads_collective, found
        states.append(jax.device_get(result.state))
        hooks.append(hook)
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert hooks[1].steps == hooks[0].steps == list(range(1, STEPS + 1))
    assert hooks[1].synced == hooks[0].synced == [6, 10]


def test_overlap_needs_a_delay_that_fits_the_window():
    rule = dataclasses.replace(_rule(2, 0.0, 2, None), overlap=True)  # 2 !< 4 // 2
    with pytest.raises(ConfigError) as error:
        check_rule(rule, "reduction.axes.slice")
    message = str(error.value)
    assert "reduction.axes.slice.overlap=true" in message and "sync_delay=2" in message
    assert "\n" not in message
