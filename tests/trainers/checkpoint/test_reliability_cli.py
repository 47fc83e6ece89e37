"""Reliability end to end: the real CLI in subprocesses (all marked slow). Most tests compare
against one uninterrupted baseline run: exact resume after SIGTERM and kill -9, restore onto
another mesh, refused checkpoints, NaN steps, exit codes, the target allowlist."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests import REPO
from tests.cli import ONE_PATH, events_dir
from tests.reliability_helpers import (
    assert_bitwise_equal,
    load_state,
    steps_snapshot,
    truncate_data,
    wait_until,
)
from trainers.checkpoint.resume import complete_steps
from trainers.exits import EXIT_CONFIG_ERROR, EXIT_NONFINITE, EXIT_PREEMPTED

pytestmark = pytest.mark.long

# --------------------------------------------------------------------------------------------
# End to end: the real CLI in subprocesses
# --------------------------------------------------------------------------------------------

COMMON = [
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    ONE_PATH,  # no start-up race: the runs compared bitwise take one path
]
RUN = [*COMMON, "trainer.steps=100", "checkpoint.every_steps=10", "checkpoint.keep=3"]


def cli_args(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainers.train", *overrides, f"hydra.run.dir={run_dir}"]


def cli(
    run_dir: Path, *overrides: str, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        cli_args(run_dir, list(overrides)),
        check=False,  # callers assert the exit status
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def start_cli(run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """Starts the CLI with stdout and stderr going to `log` (no pipe to fill up)."""
    with open(log, "w") as out:
        return subprocess.Popen(
            cli_args(run_dir, list(overrides)),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def check(result: subprocess.CompletedProcess, code: int) -> None:
    assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(events_dir(run_dir / "tb")), size_guidance={"scalars": 0})
    acc.Reload()
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted run of 100 steps, checkpoints every 10 (80, 90, 100 kept)."""
    run = tmp_path_factory.mktemp("baseline")
    check(cli(run, *RUN), 0)
    assert complete_steps(run / "checkpoints") == [80, 90, 100]
    return run


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resume_is_bitwise_identical(baseline, tmp_path):
    run, log = tmp_path / "run", tmp_path / "first.log"
    proc = start_cli(run, log, *RUN)
    wait_until(
        lambda: complete_steps(run / "checkpoints") or proc.poll() is not None,
        240,
        "a first checkpoint",
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    stopped = max(complete_steps(run / "checkpoints"))
    assert 10 <= stopped < 100
    assert f"preempted: Stopped by SIGTERM at step {stopped} of 100" in log.read_text()

    resumed = cli(run, *RUN)
    check(resumed, 0)
    assert f"Restored step {stopped} from" in resumed.stdout + resumed.stderr
    assert_bitwise_equal(
        load_state(run / "checkpoints" / "100"), load_state(baseline / "checkpoints" / "100")
    )
    losses = scalars(run, "train/loss")
    assert [s for s, _ in losses] == list(range(1, 101))  # every step logged exactly once
    assert losses == scalars(baseline, "train/loss")


@pytest.mark.slow
def test_kill_9_during_async_saves_resumes_from_the_last_complete_checkpoint(baseline, tmp_path):
    run, log = tmp_path / "run", tmp_path / "killed.log"
    proc = start_cli(run, log, *RUN, "checkpoint.every_steps=2")  # a save is nearly always running
    wait_until(
        lambda: len(complete_steps(run / "checkpoints")) >= 3 or proc.poll() is not None,
        240,
        "three checkpoints",
    )
    proc.kill()
    proc.wait(timeout=60)
    last = max(complete_steps(run / "checkpoints"))
    assert last < 100, "the run finished before it could be killed"
    if not list((run / "checkpoints").glob("*.orbax-checkpoint-tmp*")):  # killed between saves
        (run / "checkpoints" / f"{last + 2}.orbax-checkpoint-tmp" / "state").mkdir(parents=True)

    resumed = cli(run, *RUN)  # same training config; fewer saves
    check(resumed, 0)
    assert f"Restored step {last} from" in resumed.stdout + resumed.stderr
    assert not list((run / "checkpoints").glob("*.orbax-checkpoint-tmp*"))
    assert_bitwise_equal(
        load_state(run / "checkpoints" / "100"), load_state(baseline / "checkpoints" / "100")
    )


@pytest.mark.slow
def test_restore_onto_another_mesh_then_continue(baseline, tmp_path):
    run = tmp_path / "run"
    other_mesh = [*RUN, "mesh=cpu4x2", f"trainer.resume_from={baseline / 'checkpoints'}"]
    result = cli(run, *other_mesh)
    check(result, 0)
    assert "Restored step 100 from" in result.stdout + result.stderr
    assert_bitwise_equal(
        load_state(run / "checkpoints" / "100"), load_state(baseline / "checkpoints" / "100")
    )

    check(cli(run, *other_mesh, "trainer.steps=110"), 0)  # resumes from its own step 100
    assert max(complete_steps(run / "checkpoints")) == 110
    continued = [v for s, v in scalars(run, "train/loss") if s > 100]
    assert len(continued) == 10 and all(math.isfinite(v) for v in continued)


@pytest.mark.slow
def test_incompatible_checkpoint_is_refused_and_left_untouched(baseline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    before = steps_snapshot(run / "checkpoints")
    result = cli(run, *RUN, "task.hidden=[32,32]")
    check(result, EXIT_CONFIG_ERROR)
    assert "Traceback" not in result.stderr and result.stderr.count("xshard: error:") == 1
    assert "does not match this run" in result.stderr
    assert "task.hidden: [64, 64] in the checkpoint, [32, 32] now" in result.stderr
    assert steps_snapshot(run / "checkpoints") == before


@pytest.mark.slow
def test_corrupted_latest_checkpoint_is_an_error_then_falls_back_when_allowed(baseline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    truncate_data(run / "checkpoints" / "100")
    before = steps_snapshot(run / "checkpoints")
    result = cli(run, *RUN)
    check(result, EXIT_CONFIG_ERROR)
    assert "is corrupted or truncated" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert "checkpoint.fallback_to_previous=true to resume from step 90" in result.stderr
    assert steps_snapshot(run / "checkpoints") == before

    result = cli(run, *RUN, "checkpoint.fallback_to_previous=true")
    check(result, 0)
    assert "Falling back to step 90" in result.stdout + result.stderr
    assert (run / "checkpoints.corrupt" / "100").is_dir()
    assert_bitwise_equal(
        load_state(run / "checkpoints" / "100"), load_state(baseline / "checkpoints" / "100")
    )


@pytest.mark.slow
def test_nan_step_is_skipped_and_counted_and_running_out_of_data_ends_cleanly(tmp_path):
    run = tmp_path / "run"
    result = cli(
        run,
        *COMMON,
        "trainer.steps=40",
        "task.num_examples=192",  # 12 batches
        "task.nan_at_step=[4]",
        "checkpoint.every_steps=1",
        "checkpoint.keep=null",
    )
    check(result, 0)
    assert "The data ran out after step 12 of trainer.steps=40" in result.stdout + result.stderr
    assert complete_steps(run / "checkpoints") == list(range(1, 13))

    skipped = dict(scalars(run, "train/skipped_steps"))
    nonfinite = dict(scalars(run, "grad/nonfinite"))
    assert skipped[4] == 0 and skipped[5] == 1 and skipped[12] == 1
    assert nonfinite[5] > 0 and all(v == 0 for s, v in nonfinite.items() if s != 5)
    assert math.isnan(dict(scalars(run, "train/loss"))[5])

    # Update 5 used the poisoned batch 4: params and optimizer slots did not move.
    def kept(step: int) -> dict[str, np.ndarray]:
        state = load_state(run / "checkpoints" / str(step))
        return {
            k: v
            for k, v in state.items()
            if k.startswith(("['params']", "['opt_state']['inner_state']"))
        }

    assert_bitwise_equal(kept(5), kept(4))
    assert any(not np.array_equal(kept(6)[k], kept(5)[k]) for k in kept(5))
    # Params and optimizer slots are finite (the statistics in the optimizer state are NaN on
    # steps that do not compute them, by design).
    assert all(np.isfinite(v).all() for v in kept(12).values())


@pytest.mark.slow
def test_too_many_consecutive_nonfinite_steps_abort_with_exit_3(tmp_path):
    run = tmp_path / "run"
    result = cli(
        run,
        *COMMON,
        "trainer.steps=40",
        "task.nan_at_step=[8,9,10,11,12,13]",
        "trainer.max_consecutive_nonfinite=3",
        "checkpoint.every_steps=5",
    )
    check(result, EXIT_NONFINITE)
    assert "Traceback" not in result.stderr
    assert "4 consecutive steps" in result.stderr and "max_consecutive_nonfinite=3" in result.stderr
    assert complete_steps(run / "checkpoints") == [5, 10]  # steps 9, 10 skipped: params intact
    assert all(
        np.isfinite(v).all()
        for k, v in load_state(run / "checkpoints" / "10").items()
        if k.startswith("['params']")
    )
    assert max(s for s, _ in scalars(run, "train/loss")) == 11  # flushed up to the last good step


@pytest.mark.slow
def test_nonfinite_loss_without_skipping_aborts_before_checkpointing_it(tmp_path):
    run = tmp_path / "run"
    result = cli(
        run,
        *COMMON,
        "trainer.steps=40",
        "reduction.skip_nonfinite=false",
        "task.nan_at_step=[9]",
        "checkpoint.every_steps=5",
    )  # update 10 goes NaN
    check(result, EXIT_NONFINITE)
    assert "Non-finite loss nan at step 10" in result.stderr
    assert complete_steps(run / "checkpoints") == [5]


@pytest.mark.slow
@pytest.mark.parametrize(
    "run_dir, overrides, code, message",
    [
        ("{tmp}/run", ["optimizer=nope"], 1, "Could not find 'optimizer/nope'"),  # Hydra's
        ("{tmp}/run", ["optimizer._target_=os.system"], EXIT_CONFIG_ERROR, "not an allowed target"),
        ("{tmp}/run", ["mesh=v4-8"], EXIT_CONFIG_ERROR, "mesh=v4-8 expects mesh.num_devices=4"),
        ("{tmp}/run", ["trainer.batch_size=12"], EXIT_CONFIG_ERROR, "trainer.batch_size=12"),
        (
            "/proc/forbidden",
            [],
            EXIT_CONFIG_ERROR,
            "hydra.run.dir='/proc/forbidden' cannot be written",
        ),
        ("{tmp}/a_file/run", [], EXIT_CONFIG_ERROR, "a_file/run' cannot be written"),
    ],
    ids=["unknown-option", "target", "mesh", "batch", "proc-dir", "dir-under-file"],
)
def test_cli_bad_input_gives_one_line_and_exit_code(tmp_path, run_dir, overrides, code, message):
    (tmp_path / "a_file").write_text("not a directory")
    result = cli(Path(run_dir.format(tmp=tmp_path)), *COMMON, *overrides)
    check(result, code)
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
def test_user_targets_work_once_allowed(tmp_path):
    (tmp_path / "xs_user_ext.py").write_text(
        "import optax\n"
        "from trainers.tasks.mlp import MLPTask\n\n"
        "def my_sgd(learning_rate, momentum=None, nesterov=False, accumulator_dtype=None):\n"
        "    print('my_sgd called')\n"
        "    return optax.sgd(learning_rate, momentum, nesterov, accumulator_dtype)\n\n"
        "class UserMLP(MLPTask):\n"
        "    pass\n"
    )
    user = [
        "optimizer=sgd",
        "optimizer._target_=xs_user_ext.my_sgd",
        "task._target_=xs_user_ext.UserMLP",
        "trainer.steps=3",
        "checkpoint=none",
    ]
    refused = cli(tmp_path / "a", *COMMON, *user, pythonpath=tmp_path)
    check(refused, EXIT_CONFIG_ERROR)
    assert "+allowed_targets=[xs_user_ext.]" in refused.stderr

    allowed = cli(
        tmp_path / "b", *COMMON, *user, "+allowed_targets=[xs_user_ext.]", pythonpath=tmp_path
    )
    check(allowed, 0)
    assert "my_sgd called" in allowed.stdout
    assert "Run completed (done) at step 3" in allowed.stdout + allowed.stderr
