"""Helpers for the CLI tests of multi-process runs: two local processes x 4 CPU devices.

Each process is `python -m trainers.train` (or `trainers.doctor`) with the ``distributed.*``
keys of a two-process run over gloo, a coordinator on 127.0.0.1, and ``mesh=cpu8``, which
gives each of the two processes 4 simulated CPU devices (docs/multihost.md).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests import REPO
from tests.cli import one_path

PROCESSES = 2
#: A small run: task=mlp on mesh=cpu8 (4 devices per process), metrics every step.
SMALL = [
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=32",
    "trainer.log_every=1",
    "trainer.progress=false",
]
#: Steps paced by tests.multihost_hooks.Pace, so that a signal lands mid-run.
PACED = [
    "+allowed_targets=[tests.]",
    "trainer.hooks=[{_target_:tests.multihost_hooks.Pace,seconds:0.4}]",
]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed(port: int, pid: int, host: str = "127.0.0.1") -> list[str]:
    """The ``distributed.*`` overrides of process `pid` of a two-process run whose
    coordinator (process 0) is on `host`."""
    return [
        "distributed.enabled=true",
        f"distributed.coordinator_address={host}:{port}",
        f"distributed.num_processes={PROCESSES}",
        f"distributed.process_id={pid}",
        "distributed.cpu_collectives=gloo",
    ]


def start(
    logs: Sequence[Path],
    per_process: Sequence[Sequence[str]],
    *,
    module: str = "trainers.train",
    env: dict[str, str] | None = None,
    prefix: Sequence[Sequence[str]] | None = None,
) -> list[subprocess.Popen]:
    """Starts one `python -m module ARGS` per entry of `per_process`, output to `logs`.

    Args:
      logs: one log file per process (stdout and stderr).
      per_process: each process's command-line arguments.
      module: the module to run.
      env: extra environment variables (every process).
      prefix: per process, a command to run the interpreter under (e.g. ``unshare``).
    """
    procs = []
    for i, (log, args) in enumerate(zip(logs, per_process, strict=True)):
        cmd = [sys.executable, "-m", module, *args]
        if prefix is not None:
            cmd = [*prefix[i], *cmd]
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    return procs


def start_run(run_dir: Path, *overrides: str, logs: Sequence[Path]) -> list[subprocess.Popen]:
    """Starts both processes of a run in `run_dir` (the same hydra.run.dir for both)."""
    port = free_port()
    return start(
        logs,
        [
            [*one_path([*SMALL, *overrides]), *distributed(port, pid), f"hydra.run.dir={run_dir}"]
            for pid in range(PROCESSES)
        ],
    )


def finish(procs: Sequence[subprocess.Popen], logs: Sequence[Path], timeout: float = 240) -> list:
    """Waits for every process; returns their exit statuses (a hung one is killed, then fails)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in zip(procs, logs, strict=True):
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(
                f"{log.name} still running after {timeout} s:\n{tail(log)}"
            ) from None
    return codes


def run(run_dir: Path, *overrides: str, tmp: Path, name: str, expect: int = 0) -> list[Path]:
    """Runs both processes to the end; fails unless both exit with `expect`; returns the logs."""
    logs = [tmp / f"{name}.p{pid}.log" for pid in range(PROCESSES)]
    codes = finish(start_run(run_dir, *overrides, logs=logs), logs)
    for code, log in zip(codes, logs, strict=True):
        assert code == expect, f"{log.name} exited {code}, expected {expect}:\n{tail(log)}"
    return logs


def tail(log: Path, n: int = 6000) -> str:
    """The end of a log file, for assertion messages."""
    return log.read_text(errors="replace")[-n:] if log.exists() else "<no log>"


def load_arrays(step_dir: Path) -> dict[str, np.ndarray]:
    """A saved TrainState as {leaf path: array}, onto this process's first device.

    Works for checkpoints of any number of processes: the target is built from the saved
    shapes and dtypes (Orbax refuses the saved shardings of devices that are not here).
    """
    handler = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler())
    with ocp.Checkpointer(handler) as c:
        saved = c.metadata(step_dir).item_metadata["state"]
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
        tree = c.restore(step_dir, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    leaves = jax.tree_util.tree_flatten_with_path(tree["state"])[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses process `pid` listens on, read from its network namespace's
    ``/proc/<pid>/net/tcp{,6}`` (the sockets among its open files)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words, each little-endian
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found
