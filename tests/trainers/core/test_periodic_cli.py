"""The per-axis reductions from the CLI: the presets on mesh=cpu2x4_slices, their TensorBoard
tags, a sweep, resume mid-period bitwise with real Orbax checkpoints, and bad values (exit 2,
one line naming the key)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.cli import load_events, refused, run_train, scalars

COMMON = (
    "task=mlp",
    "mesh=cpu2x4_slices",
    "schedule=constant",
    "trainer.batch_size=16",
    "trainer.log_every=1",
    "checkpoint.async_save=false",
)


def _checkpoint_arrays(step_dir):
    """Every array of a checkpoint's state, by path (Orbax's own reader, no target)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as reader:
        tree = reader.restore(step_dir / "state")
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "reduction, codec",
    [("local_sgd", None), ("diloco", None), ("diloco_int8", None), ("diloco_int8", "int4")],
    ids=["local_sgd", "diloco", "diloco_int8", "diloco_int4"],
)
def test_cli_periodic_presets_log_their_syncs(tmp_path, reduction, codec):
    run_train(
        *COMMON,
        f"reduction={reduction}",
        *([f"reduction.axes.slice.comm_dtype={codec}"] if codec else []),
        "reduction.axes.slice.every_steps=4",
        "trainer.steps=8",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    tb = tmp_path / "tb"
    for name in ("pseudo_grad_norm", "outer_update_norm", "replica_drift"):
        values = scalars(tb, f"sync/slice/{name}")
        assert sorted(values) == [4, 8] and all(v > 0 for v in values.values()), name
    error = scalars(tb, "sync/slice/compression_error_norm")
    assert (error[8] > 0) == (reduction == "diloco_int8")
    sent = scalars(tb, "comm/slice/bytes_per_step")
    assert sorted(sent) == [4, 8] and sent[4] > 0
    assert sorted(scalars(tb, "train/loss")) == list(range(1, 9))


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_cli_muon_inside_diloco_with_a_compressed_outer_sync(tmp_path, codec):
    """MuLoCo (arXiv 2505.23725): Muon as the inner optimizer of each replica, the
    pseudo-gradient crossing `slice` compressed with error feedback."""
    run_train(
        *COMMON,
        "optimizer=muon",
        "optimizer.learning_rate=1e-2",
        "reduction=diloco_int8",
        f"reduction.axes.slice.comm_dtype={codec}",
        "reduction.axes.slice.every_steps=4",
        "trainer.steps=8",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    tb = tmp_path / "tb"
    assert sorted(scalars(tb, "sync/slice/pseudo_grad_norm")) == [4, 8]
    assert scalars(tb, "sync/slice/compression_error_norm")[8] > 0
    loss = scalars(tb, "train/loss")
    assert sorted(loss) == list(range(1, 9)) and loss[8] < 0.9 * loss[1]


def test_cli_warmup_steps_delay_the_first_sync(tmp_path):
    run_train(
        *COMMON,
        "reduction=diloco",
        "reduction.axes.slice.every_steps=4",
        "reduction.axes.slice.warmup_steps=2",
        "trainer.steps=8",
        "checkpoint.enabled=false",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    tb = tmp_path / "tb"
    assert sorted(scalars(tb, "sync/slice/replica_drift")) == [6]  # 2 synchronous, then 4
    assert sorted(scalars(tb, "train/loss")) == list(range(1, 9))


@pytest.mark.slow
def test_cli_outer_learning_rate_schedule_counts_outer_steps(tmp_path):
    """A ``_target_`` node as the outer optimizer's learning rate: 0.7 at the first sync,
    0 from the second on (its count is the outer optimizer's: one per sync)."""
    schedule = "{_target_:optax.linear_schedule,init_value:0.7,end_value:0.0,transition_steps:1}"
    run_train(
        *COMMON,
        "reduction=diloco",
        "reduction.axes.slice.every_steps=2",
        f"reduction.axes.slice.outer_optimizer.learning_rate={schedule}",
        "trainer.steps=4",
        "checkpoint.enabled=false",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    norms = scalars(tmp_path / "tb", "sync/slice/outer_update_norm")
    assert sorted(norms) == [2, 4] and norms[2] > 0 and norms[4] == 0, norms


@pytest.mark.slow
def test_cli_resume_mid_period_is_bitwise_the_uninterrupted_run(tmp_path):
    """Streaming DiLoCo, int8 with error feedback: 2 fragments every 4 steps, each sent at
    steps 2, 4 (fragment 1), 6, 8 and applied 2 steps later. Stopped after step 5, inside
    fragment 1's delay window (sent at 4, applied after 6), and resumed."""
    common = (
        *COMMON,
        "reduction=diloco_int8",
        "reduction.axes.slice.every_steps=4",
        "reduction.axes.slice.fragments=2",
        "reduction.axes.slice.sync_delay=2",
        "reduction.axes.slice.mix=0.5",
    )
    run_train(*common, "trainer.steps=10", f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    run_train(*common, "trainer.steps=5", f"hydra.run.dir={tmp_path / 'parts'}", cwd=tmp_path)
    sent = _checkpoint_arrays(tmp_path / "parts" / "checkpoints" / "5")
    pending = {k: v for k, v in sent.items() if "pending" in k}
    assert pending and any(np.any(v != 0) for v in pending.values())  # in flight, saved
    run_train(*common, "trainer.steps=10", f"hydra.run.dir={tmp_path / 'parts'}", cwd=tmp_path)
    whole = _checkpoint_arrays(tmp_path / "whole" / "checkpoints" / "10")
    parts = _checkpoint_arrays(tmp_path / "parts" / "checkpoints" / "10")
    assert whole.keys() == parts.keys()
    assert any("residual" in k for k in whole)  # outer params, state, residuals are saved
    for k in whole:
        np.testing.assert_array_equal(parts[k], whole[k], err_msg=k)
    # a series per fragment, each sync logged once, after its delay
    drift = [
        scalars(tmp_path / "parts" / "tb", f"sync/slice/fragment_{k}/replica_drift") for k in (0, 1)
    ]
    assert [sorted(d) for d in drift] == [[4, 8], [6, 10]]


@pytest.mark.slow
def test_cli_sweep_over_reductions(tmp_path):
    run_train(
        "--multirun",
        *COMMON,
        "reduction=mean,local_sgd,diloco",
        "trainer.steps=8",
        "checkpoint.enabled=false",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    assert len(list((tmp_path / "sweep").glob("*/result.json"))) == 3
    runs = {
        r.name.split("reduction=")[1].split(",")[0]: r for r in (tmp_path / "sweep/tb").iterdir()
    }
    assert sorted(runs) == ["diloco", "local_sgd", "mean"]
    for name, run in runs.items():
        tags = load_events(run).Tags()["scalars"]
        assert ("sync/slice/replica_drift" in tags) == (name != "mean"), name
        assert len(scalars(run, "train/loss")) == 8


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["mesh=cpu8", "reduction=local_sgd"], ["reduction.axes.slice", "['data']"]),
        (["reduction=diloco", "reduction.axes.slice.every_steps=0"], ["every_steps=0"]),
        (["reduction=diloco", "reduction.axes.slice.fragments=9"], ["fragments=9", "every_steps"]),
        (
            ["reduction=diloco", "reduction.axes.slice.comm_dtype=int3"],
            ["reduction.axes.slice.comm_dtype='int3'", "int8"],
        ),
        (
            ["reduction=diloco", "reduction.axes.slice.outer_optimizer._target_=os.system"],
            ["reduction.axes.slice.outer_optimizer._target_"],
        ),
        (
            ["reduction=diloco", "reduction.axes.slice.mix=abc"],
            ["reduction.axes.slice.mix='abc'", "0 <= mix <= 1"],
        ),
        (
            ["reduction=diloco", "reduction.axes.slice.overlap=true"],
            ["reduction.axes.slice.overlap=true", "sync_delay=0"],
        ),
    ],
    ids=["no-slice-axis", "every-steps", "fragments", "codec", "target", "mix", "overlap"],
)
def test_cli_bad_axis_values_exit_2_naming_the_key(tmp_path, overrides, fragments):
    result = run_train(
        "task=mlp",
        "mesh=cpu2x4_slices",
        *overrides,
        "trainer.steps=1",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
        check=False,
    )
    refused(result, *fragments)


@pytest.mark.slow
def test_cli_sync_statistics_are_logged_at_every_sync_whatever_log_every(tmp_path):
    run_train(
        *COMMON,
        "reduction=diloco",
        "reduction.axes.slice.every_steps=3",
        "trainer.log_every=5",  # after COMMON's log_every=1: this one wins
        "trainer.steps=9",
        "checkpoint.enabled=false",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    tb = tmp_path / "tb"
    for name in ("pseudo_grad_norm", "outer_update_norm", "replica_drift", "skipped"):
        assert sorted(scalars(tb, f"sync/slice/{name}")) == [3, 6, 9], name
    slice_sent = scalars(tb, "comm/slice/bytes_per_step")
    assert sorted(slice_sent) == [3, 6, 9]
    assert sorted(scalars(tb, "train/loss")) == [5, 9]  # the other tags keep log_every
    # `data` is reduced every step by the mean (a ring within a replica: 2 * 3/4 of 4 bytes per
    # parameter), written with the other tags; `slice` carries a quarter of the params, in
    # float32, once per 3 steps: both from the same parameter count.
    data_sent = scalars(tb, "comm/data/bytes_per_step")
    assert sorted(data_sent) == [5, 9] and data_sent[5] == data_sent[9]
    size = data_sent[5] / 6
    assert size == int(size) and slice_sent[3] * 3 == pytest.approx(4 * -(-int(size) // 4))
    # The sync program compiles when the first sync needs it, and that step says so.
    compiled = scalars(tb, "perf/compile_time_s")
    assert 3 in compiled and compiled[3] > compiled[1], compiled


@pytest.mark.slow
def test_cli_microbatches_with_a_periodic_axis_train_as_whole_batches(tmp_path):
    common = (
        *COMMON,
        "reduction=local_sgd",
        "reduction.axes.slice.every_steps=2",
        "optimizer=sgd",
        "trainer.steps=4",
    )
    run_train(*common, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    run_train(
        *common, "trainer.microbatches=2", f"hydra.run.dir={tmp_path / 'micro'}", cwd=tmp_path
    )
    whole = _checkpoint_arrays(tmp_path / "whole" / "checkpoints" / "4")
    micro = _checkpoint_arrays(tmp_path / "micro" / "checkpoints" / "4")
    assert sorted(scalars(tmp_path / "micro" / "tb", "sync/slice/replica_drift")) == [2, 4]
    outer = [k for k in whole if "outer" in k and "params" in k]
    assert outer
    for k in whole:  # the mean gradient of 2 microbatches is the whole batch's (to rounding)
        np.testing.assert_allclose(micro[k], whole[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_cli_bf16_with_diloco_syncs_float32_outer_params(tmp_path):
    run_train(
        *COMMON,
        "reduction=diloco",
        "reduction.axes.slice.every_steps=2",
        "precision=bf16",
        "trainer.steps=4",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    drift = scalars(tmp_path / "tb", "sync/slice/replica_drift")
    assert sorted(drift) == [2, 4] and all(v > 0 for v in drift.values())
    arrays = _checkpoint_arrays(tmp_path / "checkpoints" / "4")
    outer = {k: v for k, v in arrays.items() if "outer" in k}
    assert outer and all(v.dtype == np.float32 for v in outer.values()), outer.keys()
    assert all(np.isfinite(v).all() for v in outer.values())
