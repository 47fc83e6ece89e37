"""The float hyperparameters as inputs of the step programs (``Trainer(hyperparams=...)``) train
as the same values as constants did: to the last bit for an optimizer whose optax code does no
float arithmetic on them in Python (momentum SGD, with a clip and a warmup-cosine schedule: XLA
fuses a few elements' update differently around a constant), within 1e-5 for AdamW, whose
``1 - b1`` and ``1 - b2`` optax computed in float64 as constants and computes in float32 as
inputs (docs/sweeps.md)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask
from xshard.optim.factory import build_optimizer_with_rules

BATCH, STEPS = 16, 3
MESH = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
SCHEDULE = ("schedule.warmup_steps=1", "schedule.decay_steps=3", "schedule.end_factor=0.1")


def _train(built, task: MLPTask, inputs: bool) -> list[np.ndarray]:
    trainer = Trainer(
        task,
        built.tx,
        MESH,
        global_batch_size=BATCH,
        hyperparams=built.hyperparams if inputs else None,
    )
    batches = iter(task.batches(BATCH, seed=0))
    first = next(batches)
    state = trainer.init(trainer.init_params(first))
    for batch in [first, *(next(batches) for _ in range(STEPS - 1))]:
        state, _ = trainer.step(state, batch, with_stats=False)  # one program: plain steps
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.parametrize("name, rtol", [("momentum", 1e-6), ("adamw", 1e-5)])
def test_inputs_train_as_the_constants_did(name, rtol, compose_config):
    cfg = compose_config(f"optimizer={name}", "clip=0.5", *SCHEDULE)
    built = build_optimizer_with_rules(cfg, mesh=MESH)
    assert {"optimizer.learning_rate", "clip", "schedule.end_factor"} <= set(
        built.hyperparams.values
    )
    task = MLPTask()
    constants, inputs = _train(built, task, False), _train(built, task, True)
    for a, b in zip(constants, inputs, strict=True):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-7)
