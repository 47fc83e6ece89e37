"""Progress off a terminal (CI logs, ``nohup``): no bar whose redraws interleave with the log
lines, a progress line at each tenth of the run instead. The CLI in a subprocess whose stdout
and stderr are one pipe, as ``nohup`` makes them one file (a terminal's bar:
tests/trainers/app/test_sweeps_cli.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import REPO
from tests.cli import ONE_PATH

pytestmark = pytest.mark.slow


def test_off_a_terminal_progress_is_log_lines_not_a_bar(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.train",
            ONE_PATH,
            "task=mlp",
            "trainer.steps=20",
            "checkpoint=none",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        check=True,
    )
    out = proc.stdout
    assert "\r" not in out and "train:" not in out and "step/s" not in out, out[-2000:]
    progress = re.findall(r"Progress: step (\d+)/20 \((\d+)%\), loss ([\d.]+), [\d.]+ steps/s", out)
    assert [int(step) for step, _, _ in progress] == list(range(2, 21, 2))
    assert [int(pct) for _, pct, _ in progress] == list(range(10, 101, 10))
    final = re.search(r"loss: final (\S+) \(step 20\)", out)
    assert final and progress[-1][2] == final[1]  # the last line's loss is the summary's
    # Each progress line is a whole log line: nothing was drawn onto it.
    torn = [line for line in out.splitlines() if "Progress:" in line and not line.startswith("[")]
    assert torn == [], torn
