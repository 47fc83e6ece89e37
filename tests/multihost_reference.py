"""The training run the multi-host test repeats on one and on two processes."""

import jax
import numpy as np
import optax

import xshard
from trainers.core.trainer import Hook, Trainer
from trainers.tasks.mlp import MLPTask
from xshard.mesh.build import build_mesh
from xshard.stats.tree import path_str


def flat_params(params) -> dict:
    """{"layers/0/w": np.ndarray, ...}: params as host arrays, keyed by path."""
    return {
        path_str(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params))
    }


class _LastLoss(Hook):
    loss = float("nan")

    def on_step(self, step, metrics):
        self.loss = metrics["train/loss"]


def train_mlp(steps: int, batch: int):
    """Trains task=mlp on every device JAX sees (one `data` axis); returns (loss, params)."""
    mesh = build_mesh({"name": "auto", "axes": ["data"], "ici": [-1], "dcn": [-1]})
    task = MLPTask()
    trainer = Trainer(
        task, xshard.cross_shard(optax.adam(1e-2), "mean"), mesh, global_batch_size=batch
    )

    def batches(start):
        return task.batches(
            batch,
            seed=0,
            start_step=start,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    state = trainer.init(trainer.init_params(next(iter(batches(0)))))
    last = _LastLoss()
    result = trainer.fit(state, batches(0), num_steps=steps, hooks=[last])
    state = result.state
    return last.loss, state.params
