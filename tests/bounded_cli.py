"""`cli`: ``python -m trainers.train`` in a subprocess, bounded in time, for the fault tests
(a hang fails the test instead of blocking CI), and the one-line error they all expect."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests import REPO
from tests.cli import one_path

COMMON = [
    "task=mlp",
    "trainer.batch_size=16",
    "trainer.log_every=1",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
]
TIMEOUT = 240  # every run is bounded: a hang fails the test instead of blocking CI


@contextlib.contextmanager
def sigint_handled() -> Iterator[None]:
    """Children started inside get SIGINT at its default even if this process ignores it (a
    background job of a shell without job control does): exec resets a handled signal, not
    an ignored one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cli(run_dir: Path, *overrides: str, env: dict[str, str] | None = None):
    """`python -m trainers.train` (as `tests.cli.run_train`), bounded by `TIMEOUT`."""
    with sigint_handled():
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "trainers.train",
                "trainer.progress=false",
                *one_path([*COMMON, *overrides]),
                f"hydra.run.dir={run_dir}",
            ],
            cwd=REPO,
            env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,  # callers assert the exit status
        )


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, label: str) -> str:
    """Exit `code`, exactly one line on stderr (``xshard: <label>: ...``), no traceback."""
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == code, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"xshard: {label}: "), output
    assert "Traceback" not in result.stdout + result.stderr, output
    return lines[0]
