"""A step folder whose name is not the step it holds, in a copied run dir, end to end (slow).

The attack: copy a run dir, copy its step 10 to ``checkpoints/99999999999`` (past the int32
step counter) and rerun. Before, the run took the forged folder for the latest checkpoint,
restored step 10, then its checkpoint manager pruned the new steps 15 and 20 as older than
it. Now the rerun is refused at resume (exit 2, one line naming the folder and both steps),
and nothing is restored, pruned or written; once the folder is gone the same command resumes
from step 10."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import ONE_PATH, refused
from tests.reliability_helpers import load_state, snapshot, steps_snapshot
from trainers.checkpoint.io import complete_steps

pytestmark = pytest.mark.slow

COMMON = [
    ONE_PATH,
    "task=mlp",
    "trainer.batch_size=16",
    "trainer.progress=false",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    "checkpoint.every_steps=5",
    "checkpoint.keep=2",
]


def cli(run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.train",
            *COMMON,
            f"trainer.steps={steps}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # callers assert the exit status
    )


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A finished run with checkpoints 5 and 10."""
    run = tmp_path_factory.mktemp("step_folder") / "original"
    result = cli(run, 10)
    assert result.returncode == 0, result.stderr[-3000:]
    assert complete_steps(run / "checkpoints") == [5, 10]
    return run


@pytest.mark.parametrize(
    "name, strip_step, says",
    [
        ("99999999999", False, "its metadata says so"),  # > int32, the state's step counter
        ("12", False, "its metadata says so"),  # a plausible next step
        ("99999999999", True, "its state says so"),  # metadata without a step: the arrays tell
    ],
    ids=["past_int32", "plausible", "metadata_without_step"],
)
def test_a_step_folder_not_named_after_its_step_is_refused_and_nothing_pruned(
    original, tmp_path, name, strip_step, says
):
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    forged = copy / "checkpoints" / name
    shutil.copytree(copy / "checkpoints" / "10", forged)
    if strip_step:
        meta_file = forged / "metadata" / "metadata"
        meta = json.loads(meta_file.read_text())
        del meta["step"]
        meta_file.write_text(json.dumps(meta))
    checkpoints, events = steps_snapshot(copy / "checkpoints"), snapshot(copy / "tb")

    line = refused(
        cli(copy, 20), f"Checkpoint folder {forged} holds step 10 ({says})", f"not step {name}"
    )
    assert "Nothing was restored, pruned or written" in line
    assert "Traceback" not in line
    assert steps_snapshot(copy / "checkpoints") == checkpoints  # nothing pruned, nothing saved
    assert snapshot(copy / "tb") == events
    assert load_state(copy / "checkpoints" / "10")["['step']"] == 10

    # The folder moved away: the same command resumes from step 10 and keeps its new steps.
    shutil.rmtree(forged)
    resumed = cli(copy, 20)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored step 10 from" in resumed.stdout
    assert complete_steps(copy / "checkpoints") == [15, 20]
    assert load_state(copy / "checkpoints" / "20")["['step']"] == 20
