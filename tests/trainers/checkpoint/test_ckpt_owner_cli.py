"""One run per checkpoint dir, end to end with the real CLI (all slow): another run's dir is
refused untouched, a second run on a dir in use is refused, a stale lock after kill -9 is not
a lock, trainer.resume_from leaves its source byte-for-byte unchanged, and metadata of another
format falls back like corrupted metadata."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import ONE_PATH
from tests.reliability_helpers import snapshot, steps_snapshot, wait_until
from trainers.checkpoint.owner import LOCK_FILE, read_owner
from trainers.checkpoint.resume import complete_steps
from trainers.exits import EXIT_CONFIG_ERROR, EXIT_PREEMPTED

pytestmark = pytest.mark.long

COMMON = [
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    "trainer.progress=false",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    ONE_PATH,  # no start-up race per run
]
#: Runs long enough to be signalled or killed mid-training (they are, in every test).
ENDLESS = [*COMMON, "trainer.steps=1000000", "checkpoint.every_steps=20"]


def cli_args(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainers.train", *overrides, f"hydra.run.dir={run_dir}"]


def cli(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_args(run_dir, list(overrides)),
        check=False,  # callers assert the exit status
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
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


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The run's single ``xshard: error:`` line (exit 2, no traceback)."""
    check(result, EXIT_CONFIG_ERROR)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("xshard: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    """A finished run with six checkpoints (2, 4, ..., 12), all kept."""
    run = tmp_path_factory.mktemp("owner") / "a"
    check(
        cli(run, *COMMON, "trainer.steps=12", "checkpoint.every_steps=2", "checkpoint.keep=null"), 0
    )
    assert complete_steps(run / "checkpoints") == [2, 4, 6, 8, 10, 12]
    return run


@pytest.mark.slow
def test_another_runs_checkpoint_dir_is_refused_and_left_byte_for_byte_unchanged(run_a, tmp_path):
    before = snapshot(run_a)
    theirs = run_a / "checkpoints"
    pointed = [*COMMON, "trainer.steps=20", "checkpoint.every_steps=2", "checkpoint.keep=1"]

    line = one_line_error(cli(tmp_path / "b", *pointed, f"paths.checkpoint_dir={theirs}"))
    assert f"paths.checkpoint_dir='{theirs}' holds checkpoints of another run" in line
    assert f"(output dir {run_a})" in line
    assert f"trainer.resume_from='{theirs}'" in line and f"hydra.run.dir={run_a}" in line
    assert snapshot(run_a) == before

    # The same for checkpoints written before owner records: outside the run's dir, refused.
    legacy = tmp_path / "legacy"
    shutil.copytree(run_a, legacy)
    (legacy / "checkpoints" / "xshard-owner.json").unlink()
    legacy_before = snapshot(legacy)
    line = one_line_error(
        cli(tmp_path / "c", *pointed, f"paths.checkpoint_dir={legacy / 'checkpoints'}")
    )
    assert "no owner record" in line and f"hydra.run.dir={legacy}" in line
    assert snapshot(legacy) == legacy_before
    assert snapshot(run_a) == before


@pytest.mark.slow
def test_a_copied_run_dir_resumes_and_becomes_the_owner(run_a, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_a, copy)
    result = cli(copy, *COMMON, "trainer.steps=14", "checkpoint.every_steps=2", "checkpoint.keep=2")
    check(result, 0)
    assert "Restored step 12 from" in result.stdout + result.stderr
    assert complete_steps(copy / "checkpoints") == [12, 14]
    assert read_owner(copy / "checkpoints")["output_dir"] == str(copy)
    assert complete_steps(run_a / "checkpoints") == [2, 4, 6, 8, 10, 12]


@pytest.mark.slow
def test_resume_from_another_run_leaves_the_source_byte_for_byte_unchanged(run_a, tmp_path):
    before = snapshot(run_a)
    run = tmp_path / "b"
    result = cli(
        run,
        *COMMON,
        "trainer.steps=20",
        "checkpoint.every_steps=2",
        "checkpoint.keep=1",  # saves 14, 16, 18, 20 and prunes all but the last
        f"trainer.resume_from={run_a / 'checkpoints'}",
    )
    check(result, 0)
    assert "Restored step 12 from" in result.stdout + result.stderr
    assert complete_steps(run / "checkpoints") == [20]
    assert snapshot(run_a) == before
    assert read_owner(run / "checkpoints")["output_dir"] == str(run)


@pytest.mark.slow
def test_a_second_run_in_the_same_dir_is_refused_while_the_first_trains(tmp_path):
    run = tmp_path / "run"
    first = start_cli(run, tmp_path / "first.log", *ENDLESS)
    try:
        wait_until(
            lambda: complete_steps(run / "checkpoints") or first.poll() is not None,
            240,
            "the first run's first checkpoint",
        )
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]

        line = one_line_error(cli(run, *ENDLESS, timeout=120))  # it would train for hours
        assert f"paths.checkpoint_dir='{run / 'checkpoints'}' is in use by another run" in line
        assert f"pid {first.pid} on host {socket.gethostname()} since " in line
        assert f"output dir {run}" in line
    finally:
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=120)
    assert code == EXIT_PREEMPTED, (tmp_path / "first.log").read_text()[-3000:]
    assert "Traceback" not in (tmp_path / "first.log").read_text()


@pytest.mark.slow
def test_a_stale_lock_after_kill_9_does_not_block_the_rerun(tmp_path):
    run = tmp_path / "run"
    proc = start_cli(run, tmp_path / "killed.log", *ENDLESS)
    wait_until(
        lambda: complete_steps(run / "checkpoints") or proc.poll() is not None,
        240,
        "a first checkpoint",
    )
    proc.kill()
    proc.wait(timeout=60)
    lock = json.loads((run / "checkpoints" / LOCK_FILE).read_text())
    assert lock["pid"] == proc.pid  # the file stays; the lock went with the process
    last = max(complete_steps(run / "checkpoints"))

    result = cli(run, *ENDLESS, f"trainer.steps={last + 5}")
    check(result, 0)
    assert f"Restored step {last} from" in result.stdout + result.stderr
    assert max(complete_steps(run / "checkpoints")) == last + 5


@pytest.mark.slow
def test_metadata_of_another_format_is_corrupted_one_line_then_falls_back(run_a, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_a, run)
    (run / "checkpoints" / "12" / "metadata" / "metadata").write_text("[12]")
    before = steps_snapshot(run / "checkpoints")
    again = [*COMMON, "trainer.steps=12", "checkpoint.every_steps=2", "checkpoint.keep=null"]

    line = one_line_error(cli(run, *again))
    assert "found a JSON list, not an object" in line
    assert "Set checkpoint.fallback_to_previous=true to resume from step 10 instead." in line
    assert steps_snapshot(run / "checkpoints") == before

    result = cli(run, *again, "checkpoint.fallback_to_previous=true")
    check(result, 0)
    assert "Falling back to step 10" in result.stdout + result.stderr
    assert (run / "checkpoints.corrupt" / "12").is_dir()
    assert complete_steps(run / "checkpoints") == [2, 4, 6, 8, 10, 12]
