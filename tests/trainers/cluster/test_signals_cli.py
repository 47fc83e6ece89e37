"""Stop signals outside `train()`, the real CLI in subprocesses (all slow): during the imports,
after composition but before `train()` starts, and after it has returned. The entry point
latches them from its first statement (`trainers.cluster.signal_latch`): a signal before the run
stops it before its first step (exit 75, one line, nothing written), one after the run is
reported in one line and the run's status stands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli import ONE_PATH
from tests.reliability_helpers import wait_until
from trainers.checkpoint.io import complete_steps
from trainers.exits import EXIT_PREEMPTED

pytestmark = pytest.mark.slow

COMMON = [
    ONE_PATH,
    "task=mlp",
    "trainer.batch_size=16",
    "trainer.steps=3",
    "trainer.progress=false",
]
TIMEOUT = 240

CALLBACKS = """\
import os
import signal

from hydra.experimental.callback import Callback


class SignalAtStart(Callback):
    \"\"\"Sends SIGTERM to this process after composition, before the task function runs.\"\"\"

    def on_run_start(self, config, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)


class SignalAtEnd(Callback):
    \"\"\"Sends SIGTERM to this process after the task function has returned.\"\"\"

    def on_run_end(self, config, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
"""


def primary_with_callback(tmp_path: Path, callback: str) -> list[str]:
    """A primary config (trusted: it may set hydra.callbacks) adding `callback`; its flags."""
    (tmp_path / "xs_signal_callbacks.py").write_text(CALLBACKS)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text(
        textwrap.dedent(f"""\
        defaults:
          - xshard_train
          - _self_
        hydra:
          callbacks:
            signal: {{_target_: xs_signal_callbacks.{callback}}}
        """)
    )
    return [f"--config-dir={conf}", "--config-name=mine"]


def start(tmp_path: Path, run: Path, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "HYDRA_FULL_ERROR": "0",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getenv("PYTHONPATH")])),
    }
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not inherited ignored
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "trainers.train", *args, *COMMON, f"hydra.run.dir={run}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_sigint_during_the_imports_stops_the_run_before_its_first_step(tmp_path):
    run = tmp_path / "run"
    proc = start(tmp_path, run)
    maps = Path(f"/proc/{proc.pid}/maps")
    # numpy's extension is loaded after the entry point's first statement, long before JAX is.
    wait_until(
        lambda: proc.poll() is not None or "_multiarray_umath" in maps.read_text(),
        TIMEOUT,
        "the imports",
    )
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert "Stopped by SIGINT during start-up, before training any step" in one_line(err)
    assert complete_steps(run / "checkpoints") == []


def test_sigterm_before_train_starts_stops_the_run_with_a_message(tmp_path):
    run = tmp_path / "run"
    code, err = finish(start(tmp_path, run, *primary_with_callback(tmp_path, "SignalAtStart")))
    assert code == EXIT_PREEMPTED, err[-3000:]
    line = one_line(err)
    assert line.startswith("xshard: preempted: Stopped by SIGTERM during start-up"), line
    assert complete_steps(run / "checkpoints") == []


def test_sigterm_after_train_returns_is_reported_and_the_run_stands(tmp_path):
    run = tmp_path / "run"
    code, err = finish(start(tmp_path, run, *primary_with_callback(tmp_path, "SignalAtEnd")))
    assert code == 0, err[-3000:]
    assert "received SIGTERM after the run had ended" in one_line(err)
    assert complete_steps(run / "checkpoints") == [3]
    assert (run / "result.json").exists()
