"""Helpers shared by the reliability tests: checkpoint snapshots, corruption, polling."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainers.ckpt_owner import LOCK_FILE, OWNER_FILE

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
