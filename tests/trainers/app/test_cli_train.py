"""`python -m trainers.train` end to end: real Hydra, real JAX on 8 CPU devices, real events."""

import re

import numpy as np
import pytest

from tests.cli import load_events, run_train, scalars

pytestmark = [pytest.mark.slow, pytest.mark.long]

CONTRACT_TAGS = [
    "train/loss",
    "grad/global_norm",
    "grad/shard_norm_mean",
    "grad/shard_norm_max",
    "grad/nonfinite",
    "optim/learning_rate",
    "optim/update_norm",
    "params/global_norm",
    "perf/steps_per_sec",
]


def test_300_step_run_logs_every_contract_tag_and_compiles_each_program_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "task=mlp",
        "trainer.steps=300",
        "trainer.log_every=25",
        "trainer.layer_stats_every=150",
        "trainer.histogram_every=300",
        "checkpoint=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"JAX_LOG_COMPILES": "1"},
    )
    log = proc.stdout + proc.stderr
    # One executable per kind of step the run meets (plain, statistics, per-layer norms at
    # 150, histograms at 300), all compiled together before the first step: the compile time
    # is reported once, with step 1, and no step in the middle of the run compiles.
    assert len(re.findall(r"Finished XLA compilation of jit\(train_step\)", log)) == 4
    assert re.findall(r"Compiled the train step for levels ([\d, ]+) in", log) == ["0, 1, 2, 3"]
    assert f"tensorboard --logdir {run_dir / 'tb'}" in log

    events = load_events(run_dir / "tb")
    tags = set(events.Tags()["scalars"])
    assert set(CONTRACT_TAGS) <= tags
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(loss) == list(range(25, 301, 25))
    assert loss[300] < loss[25]
    # A mean over the 8 shards of `data`: a ring all-reduce, 2 * 7/8 of 4 bytes per parameter,
    # written with every write (constant).
    sent = {e.step: e.value for e in events.Scalars("comm/data/bytes_per_step")}
    assert sorted(sent) == sorted(loss) and len(set(sent.values())) == 1
    assert sent[25] > 0 and sent[25] % 7 == 0
    assert {"grad/noise_scale", "grad/noise_scale_ema", "perf/compile_time_s"} <= tags
    assert [e.step for e in events.Scalars("perf/compile_time_s")] == [1]
    assert any(t.startswith("layers/grad_norm/layers/0/w") for t in tags)
    assert any(t.startswith("grad_hist/") for t in events.Tags()["histograms"])
    assert "config/text_summary" in events.Tags()["tensors"]
    hparams = events.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(hparams)
    assert b"reduction.mode" in hparams["_hparams_/session_start_info"]


def test_clipping_statistics_reach_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        "task=mlp",
        "reduction=mean_clipped",
        "reduction.clip_per_shard=1e-4",  # every shard is clipped
        "clip=1e-5",  # and so is the reduced gradient
        "trainer.steps=4",
        "trainer.log_every=2",
        "checkpoint=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    events = load_events(run_dir / "tb")
    tags = set(events.Tags()["scalars"])
    new = {"grad/clip_fired", "grad/clip_fired_rate", "grad/clipped_norm"}
    assert new | {"grad/shard_clip_fraction", "grad/noise_scale"} <= tags
    for tag, value in (("grad/clip_fired_rate", 1.0), ("grad/shard_clip_fraction", 1.0)):
        assert [e.value for e in events.Scalars(tag)] == [value, value]
    clipped = [e.value for e in events.Scalars("grad/clipped_norm")]
    np.testing.assert_allclose(clipped, [1e-5, 1e-5], rtol=1e-4)
    norms = [e.value for e in events.Scalars("grad/global_norm")]
    assert all(n < 1e-4 * 1.0001 for n in norms)  # the mean of gradients clipped to 1e-4


def test_multirun_sweep_gives_one_run_per_job_and_sum_is_8x_mean(tmp_path):
    sweep = tmp_path / "sweep"
    run_train(
        "-m",
        "reduction=sum,mean",
        "optimizer=sgd,adam",
        "task=mlp",
        "trainer.steps=3",
        "trainer.log_every=1",
        "checkpoint=none",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    runs = {}
    for tb in (sweep / "tb").iterdir():  # one run per job: its number and the swept keys
        number, name = tb.name.split("_", 1)
        assert number.isdigit(), tb.name
        overrides = dict(item.split("=", 1) for item in name.split(","))
        assert overrides.keys() == {"optimizer", "reduction"}, tb.name  # not task=mlp etc.
        runs[overrides["optimizer"], overrides["reduction"]] = tb
        assert (sweep / tb.name / "result.json").is_file()  # the job's own dir, same name
    assert sorted(runs) == [(o, r) for o in ("adam", "sgd") for r in ("mean", "sum")]
    for run in runs.values():
        events = load_events(run)
        assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
        assert len(events.Scalars("train/loss")) == 3
    for opt in ("sgd", "adam"):
        total = scalars(runs[opt, "sum"], "grad/global_norm")[1]
        mean = scalars(runs[opt, "mean"], "grad/global_norm")[1]
        np.testing.assert_allclose(total, 8 * mean, rtol=1e-6)


def test_cpu4x2_trains_tiny_gpt_with_model_sharding(tmp_path):
    run_dir = tmp_path / "gpt"
    run_train(
        "task=tiny_gpt",
        "mesh=cpu4x2",
        "task.d_model=32",
        "task.n_layers=1",
        "trainer.steps=20",
        "trainer.batch_size=16",
        "trainer.log_every=10",
        "checkpoint=none",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    loss = scalars(run_dir / "tb", "train/loss")
    assert loss[20] < loss[10]
