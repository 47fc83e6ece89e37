"""``hydra/launcher=population`` under faults, through the real CLI (docs/sweeps.md): a
population killed with SIGKILL, its trials' saves of one step left unequal, resumes every
trial from the latest step all of them saved (DiLoCo: the replicas and the outer state too),
bitwise as it trained uninterrupted; a SIGTERM
stops every trial after the same step, each with its checkpoint, exit 75."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import ONE_PATH
from tests.reliability_helpers import assert_bitwise_equal, load_state, wait_until
from trainers.app.sweep import RESULT_FILE
from trainers.checkpoint.io import complete_steps
from trainers.exits import EXIT_PREEMPTED

pytestmark = [pytest.mark.slow, pytest.mark.long]

SWEEP = [
    "-m",
    "hydra/launcher=population",
    "optimizer=adam",
    "optimizer.learning_rate=1e-3,1e-2",
    "task=mlp",
    # DiLoCo: each trial's checkpoint holds its replicas and its outer params and momentum.
    "mesh=cpu2x4_slices",
    "reduction=diloco",
    "reduction.axes.slice.every_steps=2",
    "schedule=constant",
    "trainer.steps=1000000",  # never ends on its own
    "trainer.progress=false",
    "checkpoint.every_steps=5",
    "checkpoint.keep=null",  # step 10 is compared after the trials trained on past it
    ONE_PATH,
]


def _start(sweep: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainers.train", *SWEEP, f"hydra.sweep.dir={sweep}"],
            cwd=sweep.parent,
            env={**os.environ, "HYDRA_FULL_ERROR": "0"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _trial_checkpoints(sweep: Path) -> list[Path]:
    """The trials' checkpoint dirs, job 0's first."""
    return sorted(sweep.glob("[0-9]_*/checkpoints"))


def _until_every_trial_saved(proc: subprocess.Popen, sweep: Path, step: int, log: Path) -> None:
    def saved() -> bool:
        dirs = _trial_checkpoints(sweep)
        done = len(dirs) == 2 and all(step in complete_steps(d) for d in dirs)
        return done or proc.poll() is not None or " failed at step" in log.read_text()

    wait_until(saved, 300, f"every trial's checkpoint {step}")
    assert proc.poll() is None and " failed at step" not in log.read_text(), log.read_text()[-3000:]


def test_kill_9_then_sigterm_population_resumes_every_trial_bitwise(tmp_path):
    sweep, log = tmp_path / "sweep", tmp_path / "run.log"
    proc = _start(sweep, log)
    try:
        _until_every_trial_saved(proc, sweep, 10, log)
        os.killpg(proc.pid, signal.SIGKILL)  # no handler runs
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # What a kill during job 1's save of step 10 leaves: job 0 saved 10, job 1 only 5. The
    # uninterrupted population's step 10 is kept aside to compare with.
    first, second = _trial_checkpoints(sweep)
    reference = tmp_path / "reference"
    for n, (ckpt, keep) in enumerate([(first, 10), (second, 5)]):
        shutil.copytree(ckpt / "10", reference / str(n))
        for step in complete_steps(ckpt):
            if step > keep:
                shutil.rmtree(ckpt / str(step))

    # The same command again: every trial resumes from step 5; then SIGTERM once both saved 10.
    proc = _start(sweep, log)
    try:
        _until_every_trial_saved(proc, sweep, 10, log)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "Traceback" not in out
    assert out.count("the latest every trial of the population saved") == 1  # job 0 only
    assert (first.with_name("checkpoints.ahead") / "10").is_dir()  # moved aside, not lost
    for n, ckpt in enumerate((first, second)):
        state = load_state(ckpt / "10")
        assert any("['outer']['opt_state']" in k for k in state)  # DiLoCo's outer momentum
        assert_bitwise_equal(state, load_state(reference / str(n)))
        assert f"Restored step 5 from {ckpt / '5'}" in out
    # The SIGTERM stopped both trials after the same step, each with its checkpoint.
    records = [json.loads((c.parent / RESULT_FILE).read_text()) for c in (first, second)]
    assert [r["status"] for r in records] == ["preempted", "preempted"]
    last = {max(complete_steps(c)) for c in (first, second)}
    assert len(last) == 1 and {r["last_step"] for r in records} == last
    assert "Not in the main thread" not in out
