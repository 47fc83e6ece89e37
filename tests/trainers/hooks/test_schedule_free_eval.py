"""optimizer=schedule_free_adamw: the run's evaluation scores the schedule-free evaluation
params (``optax.contrib.schedule_free_eval_params`` of the state), not the raw params it trains,
with the params replicated and sharded (ZeRO-3); in-process on 8 simulated CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module
from jax.sharding import AxisType, Mesh

import xshard
from tests.trainers.hooks.test_evaluation import BATCH, options, reference_metrics
from trainers.core.periodic import outer_params
from trainers.core.trainer import Trainer
from trainers.hooks.evaluation import build_evaluator
from trainers.tasks.mlp import MLPTask


@pytest.mark.parametrize("stage", [0, 3])
def test_evaluation_scores_the_schedule_free_eval_params(stage):
    task = MLPTask()
    mesh = Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))
    with initialize_config_module("xshard.conf", version_base="1.3"):
        overrides = ["task=mlp", "optimizer=schedule_free_adamw", "schedule=constant"]
        cfg = compose("xshard_train", overrides=[*overrides, "optimizer.learning_rate=0.05"])
    tx = xshard.build_optimizer(cfg, mesh=mesh)
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH, zero_stage=stage)
    state = trainer.init(trainer.init_params(next(iter(task.batches(BATCH, seed=0)))))
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=2), seed=0
    )
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=5)
    state = result.state
    got = evaluator.evaluate(state)

    (sf,) = xshard.optim.slots.find_states(
        jax.device_get(state.opt_state), optax.contrib.ScheduleFreeState
    )
    raw = jax.device_get(state.params)
    x = optax.contrib.schedule_free_eval_params(sf, raw)
    for a, b in zip(jax.tree.leaves(jax.device_get(outer_params(state))), jax.tree.leaves(x)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    want, of_raw = reference_metrics(task, x, BATCH, 2), reference_metrics(task, raw, BATCH, 2)
    np.testing.assert_allclose(got["eval/loss"], want["eval/loss"], rtol=1e-5)
    assert abs(want["eval/loss"] - of_raw["eval/loss"]) > 1e-3 * want["eval/loss"]
