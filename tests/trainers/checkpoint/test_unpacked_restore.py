"""A checkpoint saved before `cross_shard`'s state packed its statistics and the guard's
counters (issue 38) restores into the packed state, bitwise (the packing itself:
tests/xshard/test_packed.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.reliability_helpers import assert_bitwise_equal
from trainers.checkpoint.resume import RestoreSource, restore_checkpoint
from trainers.checkpoint.save import CheckpointHook, state_signature
from trainers.checkpoint.unpacked import UnpackedCrossShardState, saved_unpacked
from trainers.config import CheckpointOptions
from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask
from xshard import cross_shard
from xshard.optim.cross_shard import CrossShardState

CONFIG = {
    "task": {"_target_": "trainers.tasks.mlp.MLPTask"},
    "optimizer": {"_target_": "optax.adam", "learning_rate": 1e-3},
}


def unpacked(state, fill=lambda x: x):
    """`state` with its cross_shard state in the layout checkpoints held before the packing
    (`fill` applied to the statistics)."""

    def old(cs: CrossShardState) -> UnpackedCrossShardState:
        r = jax.tree.map(fill, cs.recorded[:4])
        return UnpackedCrossShardState(*r, cs.guard, cs.comm)

    def is_cs(x) -> bool:
        return isinstance(x, CrossShardState)

    return jax.tree.map(lambda x: old(x) if is_cs(x) else x, state, is_leaf=is_cs)


def host(state) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def test_a_checkpoint_of_the_unpacked_layout_restores_packed_and_bitwise(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    task = MLPTask()
    tx = cross_shard(optax.adam(1e-3), "mean", axis_name="data", skip_nonfinite=True)
    trainer = Trainer(task, tx, mesh, global_batch_size=32)
    batch = next(iter(task.batches(32, seed=0)))
    start = trainer.init(trainer.init_params(batch))
    state, _ = trainer.step(start, batch, with_stats=False)
    # Statistics a step did not compute are NaN, which the old code's save did not check (it
    # found the slots in its state): finite numbers stand in for them here.
    old = unpacked(
        state, fill=lambda x: jnp.where(jnp.isnan(x), -1.0, x) if x.dtype == jnp.float32 else x
    )
    assert saved_unpacked(state_signature(old)) and not saved_unpacked(state_signature(state))
    hook = CheckpointHook(tmp_path, CheckpointOptions(async_save=False, keep=None), CONFIG)
    hook.save(1, old)
    hook.close()

    restored = restore_checkpoint(RestoreSource(tmp_path), start, CONFIG)

    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert_bitwise_equal(host(unpacked(restored)), host(old))
    assert int(restored.opt_state.skipped_steps) == 0 and restored.opt_state.guard.last_finite
    assert trainer.step(restored, batch, with_stats=False)[0].step == 2  # the run goes on
