"""Helpers shared by the reliability tests: checkpoint snapshots, corruption, polling."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from trainers.checkpoint.owner import LOCK_FILE, OWNER_FILE

# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def snapshot(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `directory`."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def steps_snapshot(checkpoint_dir: Path) -> dict[str, str]:
    """`snapshot` of a checkpoint dir without the lock file and owner record, which every run
    that claims the dir rewrites (its own bookkeeping, not checkpoint data)."""
    bookkeeping = {LOCK_FILE, OWNER_FILE}
    return {k: v for k, v in snapshot(checkpoint_dir).items() if k not in bookkeeping}


def load_state(step_dir: Path) -> dict[str, np.ndarray]:
    """A saved TrainState as {leaf path: array}, read with Orbax (no target tree)."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
        tree = c.restore(step_dir, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    leaves = jax.tree_util.tree_flatten_with_path(tree["state"])[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and x.shape == b[k].shape, k
        assert x.tobytes() == b[k].tobytes(), k


def truncate_data(step_dir: Path) -> None:
    """Cuts every array data file of a step to half its size (an interrupted copy, a full disk)."""
    for f in (step_dir / "state").rglob("d/*"):
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `condition` every 20 ms until it holds; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def tmpfs(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of `size` bytes mounted at `path` (skips the test if that is not possible)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


def resize(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, timeout=30)


def fill(path: Path) -> None:
    """Writes zeros into `path`/fill until the filesystem is full."""
    with contextlib.suppress(OSError), open(path / "fill", "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)


#: What a victim file outside the run dir holds: a test checks it is left byte for byte.
SECRET = b"not the run's to write\n"
