"""Helpers for tests that run the real CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]


def run_train(
    *overrides: str,
    cwd: Path,
    check: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs `python -m trainers.train OVERRIDES` in `cwd`; fails the test on a non-zero exit."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    flags = [o for o in overrides if o.startswith("-")]  # Hydra flags go before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", *flags, "trainer.progress=false", *rest],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"trainers.train {' '.join(overrides)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def load_events(tb_dir: Path) -> EventAccumulator:
    """Reads a run's event files with TensorBoard's own reader."""
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of one scalar tag."""
    return {e.step: e.value for e in load_events(tb_dir).Scalars(tag)}
