"""optimizer=muon and schedule_free_adamw under sharding.zero_stage, in-process on 8 simulated
CPU devices: a real Orbax checkpoint of the sharded state restored mid-run continues bitwise as
the uninterrupted run, and Muon with bfloat16 compute trains at every stage as at stage 0."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.hlo_helpers import dot_dtypes
from tests.reliability_helpers import assert_bitwise_equal
from tests.trainers.checkpoint.test_checkpoints import host
from tests.trainers.core.test_precision import BF16
from tests.trainers.core.test_zero import BATCH, MESH8, TASK, collectives, config, train
from trainers.checkpoint.resume import RestoreSource, restore_checkpoint
from trainers.checkpoint.save import CheckpointHook
from trainers.config import CheckpointOptions
from trainers.core.trainer import Trainer
from trainers.core.zero import zero_dim
from trainers.tasks.mlp import MLPTask
from xshard.optim.factory import build_optimizer
from xshard.optim.muon_owners import swap_state

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 14 trainers compiled: ~100 s of CPU

SAVED_AT, STEPS = 2, 4
RUN_CONFIG = {"optimizer": "under test"}  # what the checkpoint records and the restore compares
# Nine hidden layers: eight (128, 128) matrices, one per device of the mesh (`owned`).
DEEP = MLPTask(hidden=(128,) * 9)


def make_trainer(optimizer: str, stage: int, impl: str, precision=None, task=TASK) -> Trainer:
    tx = build_optimizer(config(f"optimizer={optimizer}"), mesh=MESH8)
    return Trainer(
        task,
        tx,
        MESH8,
        global_batch_size=BATCH,
        grad_impl=impl,
        zero_stage=stage,
        precision=precision,
    )


def steps(trainer: Trainer, state, batches, n: int):
    """`n` plain steps, one in flight; the state and the per-step losses."""
    losses = []
    for _ in range(n):
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        losses.append(float(metrics.device_value("train/loss")))
    return state, losses


@pytest.mark.parametrize(
    ("optimizer", "stage", "impl"),
    [
        ("muon", 1, "manual"),
        ("muon", 2, "manual"),
        ("muon", 3, "manual"),
        ("muon", 3, "gspmd"),
        ("schedule_free_adamw", 1, "manual"),
        ("schedule_free_adamw", 3, "gspmd"),
    ],
)
def test_a_checkpoint_of_the_sharded_state_resumes_bitwise(tmp_path, optimizer, stage, impl):
    # Muon at stage 3 keeps its momentum in owner order (xshard.optim.muon_owners), on DEEP's
    # eight (128, 128) matrices (manual; TASK has no group): saved in row order and swapped
    # back on restore (Trainer.row_order), so that another stage can restore it too.
    task = DEEP if (optimizer, stage, impl) == ("muon", 3, "manual") else TASK
    trainer = make_trainer(optimizer, stage, impl, task=task)
    batches = iter(task.batches(BATCH, seed=0))
    first = next(iter(task.batches(BATCH, seed=0)))
    state, _ = steps(trainer, trainer.init(trainer.init_params(first)), batches, SAVED_AT)
    options = CheckpointOptions(async_save=False, keep=None)
    hook = CheckpointHook(tmp_path, options, RUN_CONFIG, saved_order=trainer.row_order)
    hook.save(SAVED_AT, state)
    hook.close()
    saved = host(trainer.row_order(state))
    uninterrupted, _ = steps(trainer, state, batches, STEPS - SAVED_AT)

    # A fresh state of the same run is the restore's target (shapes, dtypes, shardings).
    target = trainer.init(trainer.init_params(first))
    restored = trainer.row_order(restore_checkpoint(RestoreSource(tmp_path), target, RUN_CONFIG))
    assert int(restored.step) == SAVED_AT
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
        lambda x: x.sharding, target
    )
    resumed_batches = iter(task.batches(BATCH, seed=0))
    for _ in range(SAVED_AT):
        next(resumed_batches)
    resumed, _ = steps(trainer, restored, resumed_batches, STEPS - SAVED_AT)
    assert_bitwise_equal(host(resumed), host(uninterrupted))
    if task is DEEP:  # restored at stage 1 (row order at rest): the momentum as saved
        other = make_trainer(optimizer, 1, impl, task=task)
        target = other.init(other.init_params(first))
        at_1 = other.row_order(restore_checkpoint(RestoreSource(tmp_path), target, RUN_CONFIG))
        assert_bitwise_equal(host(at_1), saved)


@functools.cache
def bf16_muon(stage: int, impl: str):
    """Losses and final params of 10 steps of Muon computing in bfloat16 (float32 master
    params and state); the dtypes of the step program's dots."""
    trainer = make_trainer("muon", stage, impl, precision=BF16)
    first = next(iter(TASK.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(first))
    dots = dot_dtypes(trainer.lower(0, state, trainer.global_batch(first)).as_text())
    state, losses = steps(trainer, state, iter(TASK.batches(BATCH, seed=0)), 10)
    return np.array(losses), jax.device_get(state.params), dots


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_with_bf16_compute_trains_as_stage_0(stage, impl):
    ref_losses, ref_params, _ = bf16_muon(0, impl)
    losses, params, dots = bf16_muon(stage, impl)
    assert dots == {"bf16", "f32"}  # the model's dots in bfloat16, Newton-Schulz's in float32
    assert losses[-1] < 0.9 * losses[0]  # it trains
    # The bf16 tests' tolerance on the losses (tests/trainers/core/test_precision.py), and the
    # params as the float32 ZeRO tests pin them (tests/trainers/core/test_zero.py).
    np.testing.assert_allclose(losses, ref_losses, rtol=0.02)
    for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params)):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


@functools.cache
def deep_muon(stage: int, impl: str):
    """Three plain steps of DEEP: the final state (Muon's momentum in row order) and, at
    stage 3, the step's collectives."""
    state, _, trainer = train(("optimizer=muon",), stage=stage, impl=impl, steps=3, task=DEEP)
    opt_state = swap_state(state.opt_state, 8) if stage == 3 else state.opt_state  # row order
    host_state = jax.device_get((state.params, opt_state))
    return host_state, (collectives(trainer) if stage else None)


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
def test_muon_at_stage_3_orthogonalises_each_matrix_on_one_owner_and_trains_as_stage_0(impl):
    # At stage 3 the params are sliced at rest and Muon's momentum is in owner order
    # (xshard.optim.muon_owners): on the manual path the gradient, swapped to that order before
    # its reduce-scatter, arrives whole at each (128, 128) matrix's owner, which orthogonalises
    # it; its update goes back to the row slices (one all-to-all for the eight). GSPMD's
    # gradient comes reduced in row order: one more all-to-all to the owners. No gather of a
    # matrix beyond the forward pass's one of all the params, no collective inside the
    # iterations (xshard.optim.muon.owned).
    # The manual path's runs are those of the test below (microbatches, a skipped step).
    run = deep_muon if impl == "gspmd" else lambda stage, _: deep_levels(stage)[::2]
    want, _ = run(0, impl)
    got, ops = run(3, impl)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    exchanged = [shapes for op, shapes in ops if op == "all-to-all"]
    assert len(exchanged) == (1 if impl == "manual" else 2)
    for shapes in exchanged:  # the eight matrices, 1/8 of each to each device
        assert sum(int(np.prod(s)) for s in shapes) == 8 * 128 * 128 // 8
    # The params for the forward pass (packed), and the one matrix of its shape, the input
    # layer's (16, 128): orthogonalised whole on every device, its momentum gathered once.
    gathered = [shapes for op, shapes in ops if op == "all-gather"]
    sliced = sum(x.size for x in jax.tree.leaves(got[0]) if zero_dim(x.shape, P(), 8) is not None)
    assert sorted(gathered) == [[(8, sliced // 8)], [(16, 128)]]
    if impl == "manual":
        assert len([op for op, _ in ops if op == "reduce-scatter"]) == 1
        reduced = sum(int(np.prod(s)) for op, shapes in ops if op == "all-reduce" for s in shapes)
        assert reduced < 64  # scalar statistics only


@functools.cache
def deep_levels(stage: int):
    """DEEP with two microbatches and a NaN at step 1, trained on the manual path by a plain
    step and two statistics steps (the NaN's: the guard skips it): the final state (Muon's
    momentum in row order), the statistics steps' metrics, and the plain step's collectives.
    (A per-layer step takes the gradient in row order, as the gspmd path does: tested there.)"""
    task = MLPTask(hidden=(128,) * 9, nan_at_step=1)
    tx = build_optimizer(config("optimizer=muon"), mesh=MESH8)
    trainer = Trainer(task, tx, MESH8, global_batch_size=BATCH, zero_stage=stage, microbatches=2)
    batches = iter(task.batches(BATCH, seed=0))
    state = trainer.init(trainer.init_params(next(iter(task.batches(BATCH, seed=0)))))
    measured = []
    for with_stats in (False, True, True):
        state, metrics = trainer.step(state, next(batches), with_stats=with_stats)
        measured.append(dict(metrics))
    row_order = trainer.row_order(state)
    ops = collectives(trainer, level=0) if stage else None  # the plain step's
    return jax.device_get((row_order.params, row_order.opt_state)), measured[1:], ops


def test_muon_in_owner_order_keeps_the_guard_microbatches_and_statistics_of_stage_0():
    # Statistics steps reduce the gradient in owner order too: its norms, non-finite count and
    # per-shard statistics are sums over all the leaves, which the order does not change.
    want, want_metrics, _ = deep_levels(0)
    got, got_metrics, _ = deep_levels(3)
    assert int(got[1].skipped_steps) == int(want[1].skipped_steps) == 1
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    for a, b in zip(want_metrics, got_metrics, strict=True):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([b[k] for k in sorted(a)], [a[k] for k in sorted(a)], rtol=1e-4)
