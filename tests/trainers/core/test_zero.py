"""sharding.zero_stage (ZeRO-1/2, FSDP) on 8 simulated CPU devices: every optimizer of the
config group trains as the replicated run, on both gradient paths; shardings after init and
after steps; the non-divisible policy and its report; the collectives in the compiled step."""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from tests import REPO
from trainers.config import ShardingOptions
from trainers.core.trainer import Trainer
from trainers.core.zero import state_report, zero_dim
from trainers.tasks.mlp import MLPTask
from xshard.errors import ConfigError
from xshard.optim.factory import build_optimizer
from xshard.optim.muon_masks import hidden_matrices
from xshard.optim.slots import get_slot

pytestmark = [pytest.mark.slow, pytest.mark.long]  # ~200 s of in-process compiles

BATCH = 32
STEPS = 20
OPTIMIZERS = sorted(p.stem for p in (REPO / "conf" / "optimizer").glob("*.yaml"))
# hidden 128: adafactor factors the (128, 128) matrix (its min_dim_size_to_factor is 128).
TASK = MLPTask(hidden=(128, 128))


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return Mesh(
        np.array(jax.devices()[:n]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape)
    )


MESH8 = mesh_of((8,), ("data",))


@functools.cache
def config(*overrides: str):
    with initialize_config_module("xshard.conf", version_base="1.3"):
        return compose("xshard_train", overrides=["task=mlp", "schedule=constant", *overrides])


def train(
    overrides=(),
    *,
    stage=0,
    impl="manual",
    mesh=MESH8,
    steps=STEPS,
    microbatches=1,
    task=TASK,
    data_axes=("data",),
):
    """Trains `task`; returns (the final state, the state's shardings after init, trainer)."""
    tx = build_optimizer(config(*overrides), mesh=mesh)
    trainer = Trainer(
        task,
        tx,
        mesh,
        data_axes=data_axes,
        global_batch_size=BATCH,
        grad_impl=impl,
        zero_stage=stage,
        microbatches=microbatches,
    )
    batches = iter(task.batches(BATCH, seed=0))
    first = next(iter(task.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(first))
    initial = trainer.state_shardings(state)
    for _ in range(steps):  # plain steps only: one small executable to compile
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        metrics.device_value("train/loss")  # one step in flight
    return state, initial, trainer


@functools.cache
def reference(overrides: tuple[str, ...], impl: str):
    state, _, _ = train(overrides, impl=impl)
    return jax.device_get((state.params, state.opt_state))


def assert_same_training(overrides, impl, stage, **kwargs):
    state, initial, _ = train(overrides, stage=stage, impl=impl, **kwargs)
    params, opt_state = reference(tuple(overrides), impl)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(jax.device_get(state.opt_state))):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    return state, initial


# ------------------------------------------------------------------------------ exactness


def train_plain_optax(stage: int, impl: str, steps: int = 5):
    """A plain optax optimizer (no `cross_shard`: the trainer reduces), as a library user
    passes it; returns the final params and optimizer state."""
    trainer = Trainer(
        TASK, optax.adam(1e-2), MESH8, global_batch_size=BATCH, grad_impl=impl, zero_stage=stage
    )
    batches = iter(TASK.batches(BATCH, seed=0))
    state = trainer.init(trainer.init_params(next(iter(TASK.batches(BATCH, seed=0)))))
    for _ in range(steps):
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        metrics.device_value("train/loss")
    return jax.device_get((state.params, state.opt_state))


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_plain_optax_optimizer_trains_as_replicated_under_every_zero_stage(stage, impl):
    expected = train_plain_optax(0, impl)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(train_plain_optax(stage, impl))):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_trains_as_replicated_with_zero2(optimizer, impl):
    assert_same_training((f"optimizer={optimizer}",), impl, stage=2)


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
@pytest.mark.parametrize("stage", [1, 3])
# muon: Newton-Schulz on whole matrices (GSPMD gathers the sharded ones); schedule_free_adamw:
# its z sequence is per-parameter state like adam's moments, sharded with it.
@pytest.mark.parametrize("optimizer", ["lamb", "lars", "adafactor", "muon", "schedule_free_adamw"])
def test_non_elementwise_optimizers_train_as_replicated_with_zero1_and_fsdp(optimizer, stage, impl):
    assert_same_training((f"optimizer={optimizer}",), impl, stage=stage)


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
def test_muon_at_stage_0_can_orthogonalise_every_matrix_on_every_device(impl):
    # optimizer.shard_orthogonalization=false (composed by Hydra, as from the CLI): every
    # device orthogonalises every matrix, so the updates need no all-gather (the default's,
    # xshard.optim.muon.spread): all-reduces only; it trains as the default stage 0.
    off = ("optimizer=muon", "optimizer.shard_orthogonalization=false")
    state, _, trainer = train(off, impl=impl)
    want = reference(("optimizer=muon",), impl)
    got = jax.device_get((state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    assert {op for op, _ in collectives(trainer)} == {"all-reduce"}


@pytest.mark.parametrize(
    "overrides, impls",
    [
        (("optimizer=lamb", "clip=0.05"), ("manual", "gspmd")),  # the global-norm clip fires
        (("optimizer=adamw", "reduction=sum"), ("manual", "gspmd")),
        (("optimizer=lamb", "reduction=mean_clipped"), ("manual",)),  # per-shard clip
        (("optimizer=adam", "reduction=mean_bf16"), ("manual",)),  # comm_dtype
    ],
)
def test_reduction_options_keep_their_meaning_under_zero2(overrides, impls):
    for impl in impls:
        assert_same_training(overrides, impl, stage=2)


def test_microbatches_reduce_once_per_update_under_zero2():
    state, _, trainer = train(("optimizer=adam",), stage=2, microbatches=2, steps=3)
    ref, _, _ = train(("optimizer=adam",), stage=0, microbatches=2, steps=3)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    reduce_scatters = [
        line for line in compiled_step(trainer).as_text().splitlines() if " reduce-scatter(" in line
    ]
    # At most one per scattered parameter (5 of 6), after the microbatch loop: not 2 each.
    assert 0 < len(reduce_scatters) <= 5


@pytest.mark.parametrize("impl", ["manual", "gspmd"])
def test_non_finite_step_is_skipped_on_every_shard_under_zero2(impl):
    # data step 1's batch has a NaN in row 0: one shard's gradient is non-finite at update 2
    task = MLPTask(hidden=(128, 128), nan_at_step=1)
    ref, _, _ = train(("optimizer=adam",), stage=0, impl=impl, steps=4, task=task)
    state, _, _ = train(("optimizer=adam",), stage=2, impl=impl, steps=4, task=task)
    assert int(state.opt_state.skipped_steps) == int(ref.opt_state.skipped_steps) == 1
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_model_axis_rules_combine_with_fsdp_on_data_x_model_mesh():
    mesh = mesh_of((4, 2), ("data", "model"))
    ref, _, _ = train(("optimizer=lamb",), stage=0, mesh=mesh, steps=5)
    for impl in ("manual", "gspmd"):
        state, _, _ = train(("optimizer=lamb",), stage=3, impl=impl, mesh=mesh, steps=5)
        # hidden layers are column-parallel over `model`; FSDP adds `data` on dim 0
        assert state.params["layers"][0]["w"].sharding.spec == P("data", "model")
        assert state.params["layers"][2]["w"].sharding.spec == P("model", "data")
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_fsdp_over_two_data_axes_on_the_cpu2x4_preset():
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    axes = ("data", "fsdp")
    opts = ("optimizer=adafactor", "mesh=cpu2x4")  # the reduction over both axes
    ref, _, _ = train(opts, stage=0, mesh=mesh, steps=5, data_axes=axes)
    for impl in ("manual", "gspmd"):
        state, _, _ = train(opts, stage=3, impl=impl, mesh=mesh, steps=5, data_axes=axes)
        assert state.params["layers"][1]["w"].sharding.spec in (P(axes), P(axes, None))
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


def test_muon_with_microbatches_and_a_skipped_step_trains_as_replicated_with_zero1():
    # Stage 1 reduce-scatters Muon's matrices and all-reduces the rest (zero_update): the
    # microbatches still reduce once, the guard skips the non-finite step on every shard, and
    # the matrices updated whole keep the shardings init chose.
    task = MLPTask(hidden=(128, 128), nan_at_step=1)
    run = functools.partial(train, ("optimizer=muon",), steps=3, microbatches=2, task=task)
    ref, _, _ = run(stage=0)
    state, initial, _ = run(stage=1)
    assert int(state.opt_state.skipped_steps) == int(ref.opt_state.skipped_steps) == 1
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    assert trainer_shardings(state) == jax.tree.map(lambda s: s.spec, initial)


# ------------------------------------------------------------------------------ shardings


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_shardings_after_init_and_after_steps(stage):
    state, initial, _ = train(("optimizer=adam",), stage=stage, steps=3)
    # the compiled step keeps the shardings init chose: nothing is resharded back
    assert trainer_shardings(state) == jax.tree.map(lambda s: s.spec, initial)
    mu = get_slot(state.opt_state, "mu")  # adam's first moment
    w = state.params["layers"][1]["w"]  # (128, 128)
    assert spec(mu["layers"][1]["w"]) == (P() if stage == 0 else P("data"))
    assert spec(w) == (P("data") if stage == 3 else P())
    # the 4-wide output bias divides by no 8: replicated, with its state
    assert spec(mu["layers"][2]["b"]) == P()
    if stage:
        shard = mu["layers"][1]["w"].addressable_shards[0].data.shape
        assert shard == (16, 128)


def spec(x):
    """`x`'s PartitionSpec without trailing Nones (``P(None, None)`` reads as ``P()``)."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def trainer_shardings(state):
    return jax.tree.map(lambda x: x.sharding.spec, state)


# ------------------------------------------------------------------------------ policy


def test_zero_dim_takes_the_first_divisible_dim_outside_the_model_axes():
    assert zero_dim((16, 128), P(), 8) == 0
    assert zero_dim((12, 128), P(), 8) == 1  # 12 does not divide by 8
    assert zero_dim((16, 128), P("model", None), 8) == 1  # dim 0 belongs to `model`
    assert zero_dim((4,), P(), 8) is None  # replicated
    assert zero_dim((), P(), 8) is None
    assert zero_dim((16, 128), P(), 1) is None  # one shard: nothing to shard


def test_start_up_report_lists_shardings_and_replicated_leaves_with_bytes():
    state, _, trainer = train(("optimizer=adam",), stage=1, steps=1)
    report = state_report(trainer.layout, state)
    assert "sharding.zero_stage=1" in report
    assert re.search(r"layers/1/w: \(128, 128\) float32 P\(\) P\('data'", report)
    assert "Left replicated over the data axes: layers/2/b (4,) (16 bytes per device" in report
    assert "Per device: params" in report


def test_bad_zero_stage_is_a_config_error_naming_the_key():
    # Checked once, where the node is read (trainers/config/zero_options.py).
    for bad in (5, -1, "x", True, 1.5, 1.0):
        with pytest.raises(ConfigError, match=r"sharding\.zero_stage="):
            ShardingOptions.from_config({"zero_stage": bad})


# ------------------------------------------------------------------------------ collectives


def compiled_step(trainer):
    """The run's one executable: the plain step (`train` runs no other)."""
    (compiled,) = trainer.executables().values()
    return compiled


def collectives(trainer, level=None):
    """(op, result shapes) of every collective in the compiled step (that of `level` where
    the trainer compiled several)."""
    found = []
    pattern = re.compile(
        r"=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\(", re.ASCII
    )
    step = compiled_step(trainer) if level is None else trainer.executable_for(level)
    for line in step.as_text().splitlines():
        m = pattern.search(line)
        if m:
            shapes = [
                tuple(int(d) for d in s.split(",") if d)
                for s in re.findall(r"f32\[([\d,]*)\]", m[1])
            ]
            found.append((m[2], shapes))
    return found


def sliced_elements(state):
    """Elements of the params ZeRO slices over 8 shards (`zero_dim` not None), and the whole
    shapes of those it leaves replicated."""
    sliced, whole = 0, set()
    for x in jax.tree.leaves(state.params):
        if zero_dim(x.shape, P(), 8) is None:
            whole.add(tuple(x.shape))
        else:
            sliced += x.size
    return sliced, whole


def test_zero2_compiled_step_reduce_scatters_and_all_gathers_once_per_dtype():
    state, _, trainer = train(("optimizer=adam",), stage=2, steps=1)
    ops = collectives(trainer)
    sliced, whole = sliced_elements(state)
    # every float32 gradient slice in ONE reduce-scatter, every updated param in ONE all-gather
    assert [shapes for op, shapes in ops if op == "reduce-scatter"] == [[(1, sliced // 8)]]
    assert [shapes for op, shapes in ops if op == "all-gather"] == [[(8, sliced // 8)]]
    full = {tuple(x.shape) for x in jax.tree.leaves(state.params)} - whole
    reduced = {s for op, shapes in ops if op == "all-reduce" for s in shapes}
    assert not reduced & full, f"a full gradient is all-reduced: {reduced & full}"


def test_zero3_gathers_the_params_once_per_dtype_for_the_forward_pass():
    state, _, trainer = train(("optimizer=adam",), stage=3, steps=1)
    ops = collectives(trainer)
    sliced, _ = sliced_elements(state)
    assert [shapes for op, shapes in ops if op == "reduce-scatter"] == [[(1, sliced // 8)]]
    assert [shapes for op, shapes in ops if op == "all-gather"] == [[(8, sliced // 8)]]


def test_zero1_all_reduces_the_gradient_and_all_gathers_the_params():
    state, _, trainer = train(("optimizer=adam",), stage=1, steps=1)
    ops = collectives(trainer)
    assert not [op for op, _ in ops if op == "reduce-scatter"]
    reduced = {s for op, shapes in ops if op == "all-reduce" for s in shapes}
    # The whole gradient in one all-reduce, packed on CPU (xshard.mesh.collectives.psum_tree).
    total = sum(x.size for x in jax.tree.leaves(state.params))
    assert (total,) in reduced
    sliced, _ = sliced_elements(state)
    assert [shapes for op, shapes in ops if op == "all-gather"] == [[(8, sliced // 8)]]


@pytest.mark.parametrize(("stage", "impl"), [(1, "manual"), (1, "gspmd"), (2, "manual")])
def test_muon_gathers_each_hidden_matrix_once_and_not_its_new_params(stage, impl):
    # Newton-Schulz needs whole matrices: each matrix's momentum is gathered once
    # (xshard.optim.muon), never the iterations partitioned over the row-sharded state; its new
    # params are then whole on every device, left out of the params' gather (zero_update).
    state, _, trainer = train(("optimizer=muon",), stage=stage, impl=impl, steps=1)
    muon = jax.tree.map(
        lambda d, x: d is not None and zero_dim(x.shape, P(), 8) is not None,
        hidden_matrices(state.params),
        state.params,
        is_leaf=lambda d: d is None or isinstance(d, MuonDimensionNumbers),
    )
    matrices = [tuple(x.shape) for x, m in zip(*map(jax.tree.leaves, (state.params, muon))) if m]
    assert matrices  # the MLP's hidden layers, sliced by ZeRO
    in_muon = sum(int(np.prod(m)) for m in matrices)
    sliced, _ = sliced_elements(state)
    ops = collectives(trainer)
    gathered = sorted(s for op, shapes in ops if op == "all-gather" for s in shapes)
    # one all-gather per hidden matrix, and one of the other updated params (as with adam)
    assert len([op for op, _ in ops if op == "all-gather"]) == len(matrices) + 1
    assert gathered == sorted([*matrices, (8, (sliced - in_muon) // 8)])
    if impl == "manual":  # the matrices' gradient reduce-scattered, at stage 1 too
        scattered = in_muon if stage == 1 else sliced
        assert [shapes for op, shapes in ops if op == "reduce-scatter"] == [[(1, scattered // 8)]]
        reduced = sum(int(np.prod(s)) for op, shapes in ops if op == "all-reduce" for s in shapes)
        total = sum(x.size for x in jax.tree.leaves(state.params))
        assert reduced < total - in_muon + 64  # the others' gradient (+ scalar statistics)
