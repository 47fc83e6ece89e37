"""``hydra/launcher=population`` as a user meets it: a real Hydra multirun whose jobs that
differ only in the learning rate train as one population, jobs of another optimizer in
another (DiLoCo on mesh=cpu2x4_slices: each population syncs its trials' periodic axis as one
program); every job with its run dir, ``result.json``, log file, TensorBoard run and
checkpoints; a diverging trial stops alone; the others train as they would alone
(docs/sweeps.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from tests.cli import ONE_PATH, load_events, run_train
from tests.trainers.app.test_sizes_cli import train_capped
from tests.trainers.core.test_periodic_cli import _checkpoint_arrays
from trainers.app.sweep import RESULT_FILE

pytestmark = [pytest.mark.slow, pytest.mark.long]

# lr=1e4 makes sgd's gradients overflow from step ~4: 3 skipped steps in a row stop that job.
TINY = ["task=mlp", "trainer.steps=8", "checkpoint=none", "trainer.max_consecutive_nonfinite=2"]
#: DiLoCo syncing every 2 steps, a checkpoint (with the outer state) every 4; the schedule's
#: length pinned (the same steps whatever ``trainer.steps``).
DILOCO = [
    *TINY[:2],
    *TINY[3:],
    "mesh=cpu2x4_slices",
    "reduction=diloco",
    "reduction.axes.slice.every_steps=2",
    "checkpoint.every_steps=4",
    "checkpoint.async_save=false",
    "schedule.decay_steps=10",
]


def test_population_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "hydra/launcher=population",
        "optimizer=sgd,adam",
        "optimizer.learning_rate=1e4,0.05",
        *DILOCO,
        "logger.peak_flops_per_device=1e9",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    assert "Population: jobs [0, 1] train as one population" in out
    assert "Population: jobs [2, 3] train as one population" in out
    assert (
        "Population: job 2 starts a population: not with job 0 "
        "(optimizer._target_: 'optax.sgd' vs 'optax.adam')" in out
    )
    results = {}
    for path in sweep.glob(f"*/{RESULT_FILE}"):
        record = json.loads(path.read_text())
        results[record["num"]] = record
    assert sorted(results) == [0, 1, 2, 3]
    assert results[0]["status"] == "diverged" and results[0]["last_step"] < 8  # sgd, lr=1e4
    assert all(results[j]["status"] == "completed" for j in (1, 2, 3))
    assert all(results[j]["last_step"] == 8 for j in (1, 2, 3))  # the others went on
    for job in (1, 3):  # TensorBoard's own reader: one run per job, its own last loss
        tb = sweep / "tb" / f"{job}_learning_rate=0.05,optimizer={'sgd' if job == 1 else 'adam'}"
        events = load_events(tb)
        last = events.Scalars("train/loss")[-1]
        assert last.step == 8 and last.value == pytest.approx(results[job]["final_loss"])
        # Its FLOP/s and MFU as a plain job's: its share of the population's program.
        flops, mfu = (events.Scalars(f"perf/{t}")[-1] for t in ("flops_per_sec", "mfu"))
        assert flops.step == mfu.step == 8 and mfu.value == pytest.approx(flops.value / 8e9)
    for job, record in results.items():  # each job's own log file, its own lines only
        (log,) = sweep.glob(f"{job}_*/train.log")
        text = log.read_text()
        assert text.count("Training mlp for 8 steps") == 1
        end = "Run diverged" if record["status"] == "diverged" else "Run completed"
        assert text.count("Run ") == 1 and end in text
    assert "4 jobs: 3 completed, 1 did not." in proc.stdout  # the sweep table sees 4 jobs

    # Job 1 alone (the basic launcher, a single run) trains as in its population, and its
    # checkpoint (the replicas, the outer params and outer momentum) is the trial's. (A
    # population with a periodic axis resuming bitwise after kill -9 and SIGTERM:
    # test_population_faults_cli.py.)
    alone = run_train("optimizer=sgd", "optimizer.learning_rate=0.05", *DILOCO, cwd=tmp_path)
    assert "Traceback" not in alone.stdout + alone.stderr
    (path,) = tmp_path.glob(f"outputs/*/*/{RESULT_FILE}")
    record = json.loads(path.read_text())
    assert record["final_loss"] == pytest.approx(results[1]["final_loss"], rel=1e-5)
    (trial,) = sweep.glob("1_*/checkpoints/4")
    ours, theirs = _checkpoint_arrays(trial), _checkpoint_arrays(path.parent / "checkpoints/4")
    assert sorted(ours) == sorted(theirs) and any("['outer']['opt_state']" in k for k in ours)
    for key, value in theirs.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def test_optuna_batches_train_as_populations(tmp_path):
    # Optuna's batches of n_jobs=2 trials reach the launcher one at a time: two populations.
    sweep = tmp_path / "study"
    proc = run_train(
        "-m",
        "hydra/sweeper=optuna",
        "hydra/launcher=population",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.sampler.seed=1",
        "optimizer=sgd",
        "optimizer.learning_rate=tag(log,interval(0.01,0.1))",
        *TINY,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert "Population: jobs [0, 1] train as one population" in out
    assert "Population: jobs [2, 3] train as one population" in out
    records = [json.loads(p.read_text()) for p in sweep.glob(f"*/{RESULT_FILE}")]
    assert sorted(r["num"] for r in records) == [0, 1, 2, 3]
    assert all(r["status"] == "completed" for r in records)
    assert "Failed experiment" not in out  # Optuna took every trial's objective
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    ours = min(records, key=lambda r: r["objective"])
    assert best["best_value"] == pytest.approx(ours["objective"])
    lr = float(next(o for o in ours["overrides"] if "learning_rate" in o).split("=")[1])
    assert best["best_params"]["optimizer.learning_rate"] == pytest.approx(lr)


def test_trials_that_do_not_fit_together_are_refused_before_compiling(tmp_path):
    # One trial of task.hidden=[7000000] with AdamW (~1.6 GiB of state) fits under the 8 GiB
    # address-space limit; two, each state held twice, do not: each job fails in one line.
    sweep = tmp_path / "sweep"
    proc = train_capped(
        tmp_path,
        "-m",
        "hydra/launcher=population",
        "task=mlp",
        "task.hidden=[7000000]",
        "mesh.num_devices=1",
        "optimizer=adamw",
        "optimizer.learning_rate=1e-3,1e-2",
        "checkpoint=none",
        "trainer.steps=2",
        ONE_PATH,
        f"hydra.sweep.dir={sweep}",
    )
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "compiling its programs" in out, out[-3000:]
    records = [json.loads(p.read_text()) for p in sweep.glob(f"*/{RESULT_FILE}")]
    assert [r["status"] for r in records] == ["failed", "failed"]
    for record in records:  # each job's log file: its one line
        (log,) = sweep.glob(f"{record['num']}_*/train.log")
        (line,) = [x for x in log.read_text().splitlines() if "2 trials need" in x]
        assert "hydra/launcher=population" in line and "RLIMIT_AS" in line
        assert "At most 1 trial fits" in line
