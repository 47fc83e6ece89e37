"""Streaming data through the real CLI (slow): the example repo's Grain `IterDataset` task,
killed with SIGKILL mid-run and rerun, ends bitwise equal to an uninterrupted run, its data
iterator's state read back from the checkpoint (trainers/data/stream.py,
trainers/checkpoint/data_state.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import ONE_PATH, scalars
from tests.reliability_helpers import assert_bitwise_equal, load_state, wait_until
from trainers.checkpoint.io import complete_steps

EXAMPLE = REPO / "examples" / "experiment_repo"
COMMON = [
    "--config-dir",
    str(EXAMPLE / "conf"),
    "task=regression_stream",
    "+allowed_targets=[my_experiments.]",
    "mesh=cpu8",
    "trainer.batch_size=32",
    "trainer.progress=false",
    "trainer.log_every=1",
    "schedule=constant",
    "checkpoint.every_steps=5",
    ONE_PATH,  # no start-up race: the runs compared bitwise take one path
]

pytestmark = pytest.mark.slow


def command(run: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "trainers.train", *COMMON, *overrides, f"hydra.run.dir={run}"]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(EXAMPLE), "HYDRA_FULL_ERROR": "0"}


def train(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        command(run, *overrides), cwd=REPO, env=environment(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_kill_9_then_rerun_is_bitwise_an_uninterrupted_run(tmp_path):
    killed = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(
            command(killed, "trainer.steps=1000000"),  # never ends on its own
            cwd=REPO,
            env=environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: (
                any(s >= 10 for s in complete_steps(killed / "checkpoints"))
                or proc.poll() is not None
            ),
            300,
            "checkpoint step 10",
        )
        proc.kill()  # SIGKILL: no handler runs
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = max(complete_steps(killed / "checkpoints"))
    assert last >= 10, (tmp_path / "killed.log").read_text()[-3000:]
    saved = json.loads(
        (killed / "checkpoints" / str(last) / "data" / "process_0-of-1.json").read_text()
    )
    assert (
        saved["next_index"] > 32 * last
    )  # the filter dropped examples: not a function of the step

    steps = last + 7  # on from the checkpoint, across the next one (every 5 steps)
    resumed = train(killed, f"trainer.steps={steps}")
    out = resumed.stdout + resumed.stderr
    assert f"Restored step {last} from" in out
    assert "Restored the data iterator's state from" in out

    baseline = tmp_path / "baseline"
    train(baseline, f"trainer.steps={steps}")
    assert_bitwise_equal(
        load_state(killed / "checkpoints" / str(steps)),
        load_state(baseline / "checkpoints" / str(steps)),
    )
    want = scalars(baseline / "tb", "train/loss")
    got = scalars(killed / "tb", "train/loss")
    assert all(got[s] == want[s] for s in range(last + 1, steps + 1))
    data = "data/process_0-of-1.json"
    for run in (killed, baseline):  # the data's position saved with the last step, equal
        assert (run / "checkpoints" / str(steps) / data).is_file()
    assert (killed / "checkpoints" / str(steps) / data).read_text() == (
        baseline / "checkpoints" / str(steps) / data
    ).read_text()
