"""Run summary lines, the sweep table and what a failed multirun job gives its sweeper."""

import json
import re

import pytest

from trainers.app.sweep import (
    BASIC_SWEEPER,
    collect_results,
    failed_job_value,
    sweep_table,
    write_result,
)
from trainers.exits import TrialFailed
from trainers.hooks.summary import COMPLETED, DIVERGED, FAILED, RunSummary

OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def _run(losses, skipped=(), start=0, checkpoint_dir=None):
    s = RunSummary()
    s.begin(num_steps=start + len(losses), start_step=start, checkpoint_dir=checkpoint_dir)
    total = 0
    for i, loss in enumerate(losses, start + 1):
        total += i in skipped
        s.on_step(
            i,
            {
                "train/loss": loss,
                "train/consecutive_skipped": float(i in skipped),
                "train/skipped_steps": float(total),
            },
        )
    s.on_end(start + len(losses), None, "done")
    return s


def test_a_run_that_skipped_steps_says_so_with_first_and_last(tmp_path):
    s = _run([3.0, 2.0, float("inf"), 1.5, float("inf")], skipped={3, 5}, checkpoint_dir=tmp_path)
    lines = s.lines(COMPLETED)
    assert lines[0] == "Run completed (done) at step 5 of 5 (5 trained in this run)."
    assert lines[1] == "  loss: final inf (step 5), best 1.5 (step 4)"
    assert lines[2] == "  skipped steps: 2 with a non-finite gradient (first step 3, last step 5)"
    assert lines[3] == f"  checkpoint: none written in {tmp_path}"
    assert s.objective is None  # never inf or NaN to a sweeper
    record = s.record(COMPLETED)
    assert record["final_loss"] == "inf" and record["best_loss"] == 1.5
    assert json.loads(json.dumps(record)) == record  # valid JSON, no NaN/Infinity


def test_evaluation_lines_best_and_objective():
    s = RunSummary()
    s.begin(num_steps=3, start_step=0, checkpoint_dir=None, objective="eval/loss")
    for step, (loss, mse) in enumerate([(2.0, 2.0), (0.5, 0.4), (float("nan"), 9.0)], 1):
        s.on_step(step, {"train/loss": 1.0 / step})
        s.on_eval(step, {"eval/loss": loss, "eval/mse": mse})
    s.on_end(3, None, "done")
    lines = s.lines(COMPLETED)
    assert lines[3] == "  checkpoint: none (checkpoint.enabled=false)"  # then the evaluation
    assert lines[4] == "  eval: final eval/loss nan, eval/mse 9 (step 3)"
    assert lines[5] == "  eval: best eval/loss 0.5, eval/mse 0.4 (step 2)"  # the lowest eval/loss
    assert s.objective is None  # the final eval/loss is NaN: never to a sweeper
    record = s.record(COMPLETED)
    assert record["eval"] == {"eval/loss": "nan", "eval/mse": 9.0} and record["eval_step"] == 3
    assert record["best_eval"] == {"eval/loss": 0.5, "eval/mse": 0.4}
    assert record["objective_key"] == "eval/loss"
    assert json.loads(json.dumps(record)) == record
    s.on_eval(4, {"eval/loss": 0.25, "eval/mse": 0.2})
    # The final evaluation is the best: one line, then the compile time.
    assert s.objective == 0.25 and s.lines(COMPLETED)[5:] == ["  compile: - (no compilation cache)"]


def test_a_clean_run_and_a_failure_before_any_step():
    s = _run([2.0, 1.0], start=10)
    assert s.lines(COMPLETED)[0].endswith("at step 12 of 12 (2 trained in this run).")
    assert s.lines(COMPLETED)[2] == "  skipped steps: none"
    assert s.lines(COMPLETED)[3] == "  checkpoint: none (checkpoint.enabled=false)"
    assert s.objective == 1.0
    early = RunSummary()
    assert early.lines(FAILED) == ["Run failed during start-up, before any step."]


def _record(status, objective=None, sweeper=BASIC_SWEEPER):
    return {
        "num": 1,
        "status": status,
        "last_step": 7,
        "reason": "boom",
        "sweeper": sweeper,
        "objective": objective,
    }


def test_failed_job_value_per_sweeper():
    assert failed_job_value(_record(DIVERGED), None) is None  # basic sweeper: go on
    assert failed_job_value(_record(DIVERGED, sweeper=OPTUNA), 1e9) == 1e9  # a penalty
    with pytest.raises(TrialFailed, match="diverged at step 7: boom"):
        failed_job_value(_record(DIVERGED, sweeper=OPTUNA), None)


def test_sweep_table_marks_the_best_and_reads_only_this_sweeps_results(tmp_path):
    jobs = [
        ("a", {"num": 0, "status": DIVERGED, "objective": None, "reason": "nan at step 4"}),
        ("b", {"num": 1, "status": COMPLETED, "objective": 0.5, "reason": "done"}),
        ("c", {"num": 2, "status": COMPLETED, "objective": 0.25, "reason": "done"}),
    ]
    for name, record in jobs:
        write_result(
            tmp_path / name,
            {
                **record,
                "overrides": [f"x={name}"],
                "last_step": 4,
                "num_steps": 9,
                "written_at": 100.0,
            },
        )
    write_result(tmp_path / "old", {"num": 0, "status": COMPLETED, "written_at": 1.0})
    records = collect_results(tmp_path, since=50.0)
    assert [r["overrides"] for r in records] == [["x=a"], ["x=b"], ["x=c"]]
    table = sweep_table(records).splitlines()
    assert table[2] == "| 0 | x=a | diverged | - | 4/9 | nan at step 4 |"
    assert table[4] == "| 2 | x=c | completed | 0.25 (best) | 4/9 |  |"
    assert table[-1] == "3 jobs: 2 completed, 1 did not."
    assert "(best)" in sweep_table(records, maximize=True).splitlines()[3]


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.profile_steps=[3,1]", "trainer.profile_steps=[3, 1]: expected [first, last]"),
        ("trainer.profile_steps=[0,2]", "1 <= first <= last"),
        ("trainer.failed_objective=nan", "trainer.failed_objective=nan: expected a number"),
    ],
)
def test_new_trainer_keys_are_checked(compose_config, override, message):
    from trainers.config import TrainerOptions
    from xshard.config import read_node
    from xshard.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        read_node(TrainerOptions, compose_config(override).trainer, "trainer")


@pytest.mark.parametrize(
    "override, message",
    [
        ("logger.noise_ema_steps=0", "logger.noise_ema_steps=0"),
        ("logger.peak_flops_per_device=-1", "logger.peak_flops_per_device=-1"),
    ],
)
def test_new_logger_keys_are_checked(compose_config, override, message):
    from trainers.config import LoggerOptions
    from xshard.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        LoggerOptions.from_config(compose_config(override).logger)
