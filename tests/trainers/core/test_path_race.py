"""`trainers.core.path_race.race` (``trainer.grad_impl=auto``) on 8 simulated CPU devices:
the paths timed on a copy, the run's state untouched, a path the config refuses left out."""

import jax
import numpy as np
import optax
import pytest

import xshard
from tests.trainers.core.test_trainer import BATCH, mesh_of
from trainers.core.path_race import race, race_key
from trainers.core.step import STATS
from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask


def _trainers(task, clip_per_shard=None):
    tx = xshard.cross_shard(
        optax.adam(1e-3), "mean", skip_nonfinite=True, clip_per_shard=clip_per_shard
    )
    mesh = mesh_of((8,), ("data",))
    return {
        impl: Trainer(task, tx, mesh, global_batch_size=BATCH, grad_impl=impl)
        for impl in ("manual", "gspmd")
    }


@pytest.fixture(scope="module")
def raced():
    task = MLPTask()
    trainers = _trainers(task)
    first = next(iter(task.batches(BATCH, seed=0)))
    state = trainers["manual"].init(trainers["manual"].init_params(first))
    before = jax.device_get(state)
    # `ahead`: the first path's other programs (here its statistics step) compile in the race.
    ahead = lambda trainer: trainer.compile_levels(state, first, [STATS])
    return race(trainers, state, first, ahead=ahead), trainers, state, before, task


def test_race_times_both_paths_and_leaves_the_state_as_it_was(raced):
    found, trainers, state, before, _ = raced
    assert set(found.ms_per_step) == {"manual", "gspmd"} and found.refused == {}
    assert all(ms > 0 for ms in found.ms_per_step.values())
    assert found.chosen == min(found.ms_per_step, key=found.ms_per_step.__getitem__)
    assert found.steps_per_block >= 1 and found.seconds > 0
    # The timed steps ran on a copy: the run's state is neither donated nor changed.
    assert int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), before)
    # Both plain programs were compiled once, by the race; the run's steps reuse them.
    assert all(t.executable_for(0) is not None for t in trainers.values())
    assert trainers["manual"].executable_for(STATS) is not None  # ahead: the first path only
    assert trainers["gspmd"].executable_for(STATS) is None


def test_a_run_after_the_race_equals_a_run_on_the_chosen_path_alone(raced):
    found, trainers, state, _, task = raced
    fresh = _trainers(task)[found.chosen]
    first = next(iter(task.batches(BATCH, seed=0)))
    alone = fresh.init(fresh.init_params(first))
    for _, batch in zip(range(3), task.batches(BATCH, seed=0)):  # the raced program's steps
        state, _ = trainers[found.chosen].step(state, batch, with_stats=False)
        alone, _ = fresh.step(alone, batch, with_stats=False)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(alone))


def test_per_shard_clipping_leaves_the_manual_path_alone_without_timing():
    task = MLPTask()
    trainers = _trainers(task, clip_per_shard=1.0)
    first = next(iter(task.batches(BATCH, seed=0)))
    state = trainers["manual"].init(trainers["manual"].init_params(first))
    found = race(trainers, state, first)
    assert found.chosen == "manual" and found.ms_per_step == {} and found.steps_per_block == 0
    assert "trainer.grad_impl='gspmd' computes no per-shard gradients" in found.refused["gspmd"]
    assert race_key(trainers, state, first) is None  # nothing timed: nothing to remember


def test_the_race_key_names_the_programs_and_not_the_trainers_that_lower_them(raced):
    _, trainers, state, _, task = raced
    first = next(iter(task.batches(BATCH, seed=0)))
    key = race_key(trainers, state, first)
    assert key is not None and key == race_key(_trainers(task), state, first)
    wider = MLPTask(hidden=(64, 128))
    others = _trainers(wider)
    other_state = others["manual"].init(others["manual"].init_params(first))
    assert race_key(others, other_state, first) not in (None, key)
