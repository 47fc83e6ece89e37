"""A stop signal during start-up, the real CLI in subprocesses (slow): the run stops before
its first step and writes nothing, or stops while compiling and a rerun finishes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import REPO
from tests.bounded_cli import COMMON, TIMEOUT, assert_one_line_error, cli, sigint_handled
from tests.cli import one_path
from tests.reliability_helpers import wait_until
from trainers.checkpoint.io import complete_steps
from trainers.exits import EXIT_PREEMPTED

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------
# A stop signal during start-up
# --------------------------------------------------------------------------------------------

SIGNALLING_TASK = """\
import signal

from trainers.tasks.mlp import MLPTask
from tests import REPO


class SignalledMLP(MLPTask):
    \"\"\"An MLP task whose construction (start-up, before any step) receives a SIGINT.\"\"\"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        signal.raise_signal(signal.SIGINT)
"""


def test_sigint_during_start_up_stops_before_the_first_step_and_writes_nothing(tmp_path):
    (tmp_path / "xs_signalled_task.py").write_text(SIGNALLING_TASK)
    run = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getenv("PYTHONPATH")]))}
    stopped = cli(
        run,
        "trainer.steps=20",
        "task._target_=xs_signalled_task.SignalledMLP",
        "+allowed_targets=[xs_signalled_task.]",
        env=env,
    )
    line = assert_one_line_error(stopped, EXIT_PREEMPTED, "preempted")
    assert "Stopped by SIGINT during start-up, before training any step" in line
    assert "Rerun the same command to start afresh" in line
    assert complete_steps(run / "checkpoints") == [] and not any((run / "tb").rglob("events.*"))

    rerun = cli(run, "trainer.steps=20")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "from step 0." in rerun.stdout and complete_steps(run / "checkpoints") == [20]


def test_sigint_while_compiling_stops_the_run_and_a_rerun_finishes_it(tmp_path):
    run, log = tmp_path / "run", tmp_path / "first.log"
    args = [
        *one_path(COMMON),
        "trainer.progress=false",
        "trainer.steps=300",
        "checkpoint.every_steps=0",
    ]
    with open(log, "w") as out, sigint_handled():
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainers.train", *args, f"hydra.run.dir={run}"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # Logged right before `fit`, which compiles the step before the first update.
        wait_until(
            lambda: "Training mlp for 300 steps" in log.read_text() or proc.poll() is not None,
            TIMEOUT,
            "the start of training",
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) == EXIT_PREEMPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    done = complete_steps(run / "checkpoints")
    if done:  # the signal came during compilation: the first step ends, is saved, the run stops
        assert len(done) == 1 and done[0] < 300
        assert f"Stopped by SIGINT at step {done[0]} of 300" in text
    else:  # it came before `fit` started its first step
        assert "Stopped by SIGINT during start-up" in text

    rerun = cli(run, "trainer.steps=300", "checkpoint.every_steps=0")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert complete_steps(run / "checkpoints")[-1] == 300
