"""Hooks for the multi-process CLI tests: steps slow enough to send a signal mid-run, and each
process's own copy of a periodic run's outer params after every sync."""

import os
import time
from pathlib import Path

import jax
import numpy as np

from trainers.core.trainer import Hook


class Pace(Hook):
    """Sleeps `seconds` after each step's metrics (the loop's pace, not the numbers)."""

    def __init__(self, seconds: float = 0.1):
        self.seconds = seconds

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        time.sleep(self.seconds)


class DumpOuter(Hook):
    """After every `every`-th step, writes what this process holds of a periodic run's state:
    ``<dir>/step<N>.process<i>.npz`` with the outer params (``outer_<j>``: leaf j, from this
    process's first device) and its replicas' params (``replica_<j>``: the rows of the replica
    axis this process holds, from its first device; where that device holds a whole row and
    only a part of the outer params, as with ``sharding.zero_stage=1``, the same part of each
    row, so that ``replica_<j>[0]`` and ``outer_<j>`` compare)."""

    def __init__(self, dir: str, every: int):
        self.dir, self.every = Path(dir), every

    def wants_state(self, step: int) -> bool:
        return step % self.every == 0

    def on_state(self, step: int, state) -> None:
        def local(x):
            return np.asarray(x.addressable_shards[0].data)

        outer_leaves = [x for frag in state.outer.params for x in frag]
        outer = [local(x) for x in outer_leaves]
        replicas = [
            r[(slice(None), *o.addressable_shards[0].index)] if r.shape[1:] == o.shape else r
            for r, o in zip(map(local, jax.tree.leaves(state.params)), outer_leaves, strict=True)
        ]
        self.dir.mkdir(parents=True, exist_ok=True)
        arrays = {f"outer_{j}": x for j, x in enumerate(outer)}
        arrays |= {f"replica_{j}": x for j, x in enumerate(replicas)}
        # written whole, then renamed: a test that kills this process once the file appears
        # must not find it cut short
        name = f"step{step}.process{jax.process_index()}"
        np.savez(self.dir / f"{name}.partial.npz", **arrays)
        os.replace(self.dir / f"{name}.partial.npz", self.dir / f"{name}.npz")


class WaitForText(Hook):
    """After step `step`, waits (up to `timeout` seconds) until the file `path` holds `text`
    at least `count` times: an elastic group held until a peer has (re)started."""

    def __init__(self, path: str, text: str, count: int, step: int, timeout: float = 120.0):
        self.path, self.text, self.count = Path(path), text, count
        self.step, self.timeout = step, timeout

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step != self.step:
            return
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.path.exists() and self.path.read_text().count(self.text) >= self.count:
                return
            time.sleep(0.1)
