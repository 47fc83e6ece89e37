"""Sweeps and run reports as a user meets them: real Hydra multiruns (basic launcher,
submitit_local, Optuna), TensorBoard's own readers, the CLI's output."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import yaml

from tests import REPO
from tests.cli import hparams_dashboard, load_events, run_train
from trainers.app.sweep import RESULT_FILE, SWEEP_SUMMARY_FILE

pytestmark = [pytest.mark.slow, pytest.mark.long]

# The path named after the swept key, so that the table's rows start with it (tests.cli would
# otherwise put trainer.grad_impl first).
TINY = [
    "task=mlp",
    "optimizer=sgd",
    "trainer.steps=12",
    "checkpoint=none",
    "trainer.grad_impl=manual",
]
# lr=1e4 makes every gradient overflow from step ~4: 3 skipped steps in a row stop the job.
DIVERGES = ["trainer.max_consecutive_nonfinite=2"]


def _results(sweep: Path) -> dict[float, dict]:
    """{learning rate: result.json} of a sweep's jobs."""
    out = {}
    for path in sweep.glob(f"*/{RESULT_FILE}"):
        record = json.loads(path.read_text())
        lr = next(o for o in record["overrides"] if o.startswith("optimizer.learning_rate="))
        out[float(lr.split("=", 1)[1])] = record
    return out


def _table(sweep: Path) -> list[str]:
    return (sweep / SWEEP_SUMMARY_FILE).read_text().splitlines()


def test_basic_launcher_sweep_goes_on_after_a_diverging_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "optimizer.learning_rate=1e4,0.05",
        *TINY,
        *DIVERGES,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    results = _results(sweep)
    assert results[1e4]["status"] == "diverged" and results[1e4]["objective"] is None
    assert results[1e4]["last_step"] < 12 and "max_consecutive_nonfinite" in results[1e4]["reason"]
    assert results[0.05]["status"] == "completed" and results[0.05]["last_step"] == 12
    assert results[0.05]["objective"] == pytest.approx(results[0.05]["final_loss"])
    # The table: printed at the end and written to the sweep dir.
    table = _table(sweep)
    assert table[0] == "| job | overrides | status | objective | last step | reason |"
    assert re.match(
        r"\| 0 \| optimizer.learning_rate=10000.0 .*\| diverged \| - \| \d+/12 \|", table[2]
    )
    assert re.match(
        r"\| 1 \| optimizer.learning_rate=0.05 .*\| completed \| [\d.]+ \(best\) \|", table[3]
    )
    assert "\n".join(table) in proc.stdout
    # Each job's summary lines, and the diverged job's reason once.
    assert (
        "Run diverged at step" in proc.stdout and "Run completed (done) at step 12" in proc.stdout
    )
    assert out.count("Job 0 diverged at step") == 1

    # TensorBoard: runs named by job number and the swept key, short (logger.run_names=short);
    # the swept key among the first columns; status.
    dash = hparams_dashboard(sweep / "tb", limit=5)
    assert sorted(dash["runs"]) == ["0_learning_rate=1e+04", "1_learning_rate=0.05"]
    assert "optimizer.learning_rate" in dash["hparams"]
    assert {r["status"] for r in dash["runs"].values()} == {"STATUS_SUCCESS", "STATUS_FAILURE"}
    diverged = next(r for r in dash["runs"].values() if r["status"] == "STATUS_FAILURE")
    assert diverged["hparams"]["optimizer.learning_rate"] == 1e4


def test_jobs_that_differ_only_in_float_hyperparameters_compile_nothing(tmp_path):
    # The learning rate and weight decay are inputs of the programs (docs/sweeps.md): with the
    # cache the first job filled, jobs 2..6 read every program back.
    sweep = tmp_path / "sweep"
    run_train(
        "-m",
        "optimizer.learning_rate=1e-3,2e-3,3e-3",
        "optimizer.weight_decay=0,1e-2",
        "task=mlp",
        "optimizer=adamw",
        "trainer.steps=2",
        "checkpoint=none",
        f"trainer.compilation_cache_dir={tmp_path / 'cache'}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    records = [json.loads(p.read_text()) for p in sweep.glob(f"*/{RESULT_FILE}")]
    assert len(records) == 6 and {r["status"] for r in records} == {"completed"}
    counts = sorted((r["compilation_cache_misses"], r["compilation_cache_hits"]) for r in records)
    first, rest = counts[-1], counts[:-1]
    assert first[0] > 0 and first[1] == 0, counts  # the first job compiled every program
    assert all(misses == 0 and hits > 0 for misses, hits in rest), counts


def test_submitit_local_sweep_runs_each_job_in_its_own_process(tmp_path):
    sweep = tmp_path / "sweep"
    run_train(
        "-m",
        "hydra/launcher=submitit_local",
        "optimizer.learning_rate=1e4,0.05",
        *TINY,
        *DIVERGES,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    results = _results(sweep)
    assert {k: r["status"] for k, r in results.items()} == {1e4: "diverged", 0.05: "completed"}
    assert len({r["pid"] for r in results.values()}) == 2  # submitit: one process per job
    assert _table(sweep)[-1] == "2 jobs: 1 completed, 1 did not."


def test_optuna_study_over_a_learning_rate_range_survives_diverging_trials(tmp_path):
    # As the README runs it: no max_failure_rate, Optuna's batches of 2 trials (n_jobs=2).
    sweep = tmp_path / "study"
    proc = run_train(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler.seed=1",  # trials at lr 3.2, 210 (diverges), 0.01, 0.65
        "optimizer.learning_rate=tag(log,interval(0.01,10000))",
        *TINY,
        *DIVERGES,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    records = list(_results(sweep).values())
    assert len(records) == 4
    diverged = [r for r in records if r["status"] == "diverged"]
    completed = [r for r in records if r["status"] == "completed"]
    assert diverged and len(completed) >= 2
    # Optuna counted the diverged trial as failed (not NaN, no crash) and reports the best.
    assert "Failed experiment: diverged at step" in proc.stdout + proc.stderr
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    ours = min(completed, key=lambda r: r["objective"])
    assert best["best_value"] == pytest.approx(ours["objective"])
    lr = float(next(o for o in ours["overrides"] if "learning_rate" in o).split("=")[1])
    assert best["best_params"]["optimizer.learning_rate"] == pytest.approx(lr)
    assert sum("(best)" in line for line in _table(sweep)) == 1
    assert _table(sweep)[-1] == "4 jobs: 3 completed, 1 did not."


def test_a_chosen_max_failure_rate_still_ends_the_study_with_its_table(tmp_path):
    sweep = tmp_path / "study"
    proc = run_train(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler.seed=1",  # the first batch: lr 3.2, 210 (diverges)
        "hydra.sweeper.max_failure_rate=0",
        "optimizer.learning_rate=tag(log,interval(0.01,10000))",
        *TINY,
        *DIVERGES,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "with max_failure_rate=0.0" in proc.stdout + proc.stderr
    assert len(_results(sweep)) == 2  # the second batch never ran
    assert _table(sweep)[-1] == "2 jobs: 1 completed, 1 did not."  # written after each job


def _cli(run_dir: Path, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI with the progress bar on, stdout and stderr on one terminal (a pseudo-terminal:
    off a terminal there is no bar, `trainers.hooks.monitor.ProgressHook`)."""
    main, terminal = pty.openpty()
    # A terminal 50 rows by 200 columns (a new pseudo-terminal has 0 columns: an empty bar).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainers.train", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    returncode = proc.wait(timeout=600)
    output = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return subprocess.CompletedProcess(proc.args, returncode, output, "")


def _screen(output: str) -> list[str]:
    """What a terminal shows: each line as left after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in output.split("\n")]


def test_a_run_that_skipped_steps_says_so_and_the_bar_agrees_with_the_log(tmp_path):
    run = tmp_path / "run"
    proc = _cli(
        run,
        "task=mlp",
        "task.nan_at_step=[3,5]",  # data steps from 0: the batches of updates 4 and 6
        "trainer.steps=12",
        "trainer.log_every=4",
        "checkpoint.every_steps=0",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    screen = _screen(proc.stdout)
    summary = [line.split(" - ", 1)[1] for line in screen if "[trainers.train]" in line]
    head = next(i for i, s in enumerate(summary) if s.startswith("Run completed"))
    assert summary[head] == "Run completed (done) at step 12 of 12 (12 trained in this run)."
    assert summary[head + 2] == (
        "  skipped steps: 2 with a non-finite gradient (first step 4, last step 6)"
    )
    assert summary[head + 3] == f"  checkpoint: step 12 in {run / 'checkpoints' / '12'}"
    final = re.match(r"  loss: final (\S+) \(step 12\), best (\S+)", summary[head + 1])
    assert final, summary
    # The bar's last state shows the same final loss; no log line was printed onto the bar.
    bars = re.findall(r"train: 100%.*?loss=([^,\]]+)", proc.stdout)
    assert bars and bars[-1] == final[1]
    assert not [line for line in screen if "[trainers." in line and "train:" in line]
    record = json.loads((run / RESULT_FILE).read_text())
    assert record["skipped_steps"] == 2 and record["first_skipped_step"] == 4
    assert record["checkpoint"] == str(run / "checkpoints" / "12")


def test_a_diverged_run_exits_3_names_no_checkpoint_it_did_not_write_and_says_it_once(tmp_path):
    run = tmp_path / "run"
    proc = _cli(
        run,
        *TINY,
        *DIVERGES,
        "optimizer.learning_rate=1e4",
        "trainer.progress=false",
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stdout[-3000:]
    assert proc.stdout.count("more than trainer.max_consecutive_nonfinite=2") == 1
    assert "xshard: error: " in proc.stdout
    assert "checkpoint is intact" not in proc.stdout
    assert "  checkpoint: none (checkpoint.enabled=false)" in proc.stdout
    assert json.loads((run / RESULT_FILE).read_text())["status"] == "diverged"
    assert "more than trainer.max_consecutive_nonfinite=2" in (run / "train.log").read_text()


def test_profile_steps_write_a_trace_the_profile_plugin_lists(tmp_path):
    run = tmp_path / "run"
    run_train(
        "task=mlp",
        "trainer.steps=5",
        "trainer.profile_steps=[3,4]",
        "checkpoint=none",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    (tb_run,) = (run / "tb").iterdir()
    traces = list(tb_run.glob("plugins/profile/*/*.xplane.pb"))
    assert traces, list(tb_run.rglob("*"))
    assert "perf/examples_per_sec" in load_events(run / "tb").Tags()["scalars"]
    plugin = pytest.importorskip("xprof.profile_plugin")
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin

    logdir = str(run / "tb")
    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(logdir)
    mux.Reload()
    context = base_plugin.TBContext(
        logdir=logdir,
        data_provider=data_provider.MultiplexerDataProvider(mux, logdir),
        multiplexer=mux,
        flags=argparse.Namespace(master_tpu_unsecure_channel=""),
    )
    runs = list(plugin.ProfilePlugin(context).generate_runs())
    assert runs == [f"{tb_run.name}/{traces[0].parent.name}"]


def test_help_lists_groups_exit_codes_and_allowlist(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", "--help"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    text = proc.stdout
    assert "optimizer: adafactor, adagrad, adam, adamw" in text
    assert "task: flax_linen, flax_nnx, mlp, tiny_gpt" in text
    assert "xshard_schemas" not in text and "hydra/launcher" not in text
    for code in ("0 ", "1 ", "2 ", "3 ", "75 "):
        assert f"\n  {code}" in text
    from xshard.config.targets import DEFAULT_ALLOWED_TARGETS

    assert ", ".join(DEFAULT_ALLOWED_TARGETS) in text
    assert "allowed_targets=[mypkg.]" in text
