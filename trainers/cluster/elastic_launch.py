"""Launching elastic replica groups: torchft's lighthouse and a local supervisor.

`serve_lighthouse` runs torchft's lighthouse (the quorum server) in this process until a
signal. `supervise` starts the lighthouse and N groups on one host, each
``python -m trainers.train <overrides> reduction.axes.<axis>.elastic.group=<i>`` with its own
run dir and log (``<out>/group_<i>/``, ``<out>/group_<i>.log``), and restarts a group that
dies (any exit but 0, a signal too) up to ``restarts`` times; the others go on. A group may be
several ``jax.distributed`` processes (``GroupLaunch.processes``): when one dies the others
are killed and the group restarts whole. Each group's process ids are in
``<out>/group_<i>.pid``. Used by ``python -m trainers.elastic`` (its ``--help``;
docs/reductions.md).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.exits import EXIT_PEER_LOST
from xshard.config.elastic_groups import DEFAULT_LIGHTHOUSE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LighthouseOptions:
    """torchft's lighthouse: where it listens and when it forms a quorum.

    Attributes:
      bind: ``host:port`` it listens on (127.0.0.1: this host only).
      min_groups: the fewest groups a quorum has.
      join_timeout_s: seconds it waits for heartbeating groups to join a quorum (longer than a
        period of inner steps, or a restarted group forms a quorum alone).
      heartbeat_timeout_s: seconds without a heartbeat after which a group is dropped (the
        stall the others see when one dies).
    """

    bind: str = DEFAULT_LIGHTHOUSE
    min_groups: int = 1
    join_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0


def start_lighthouse(options: LighthouseOptions) -> Any:
    """torchft's `LighthouseServer` with `options`, started (its ``shutdown`` stops it)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=options.bind,
        min_replicas=options.min_groups,
        join_timeout_ms=int(options.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(options.heartbeat_timeout_s * 1000),
    )


def serve_lighthouse(options: LighthouseOptions) -> int:
    """Runs the lighthouse until SIGINT or SIGTERM; returns the exit status (0)."""
    server = start_lighthouse(options)
    log.info("Lighthouse on %s (min_groups %d).", options.bind, options.min_groups)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _: stopping.append(s))
    while not stopping:
        time.sleep(0.2)
    server.shutdown()
    return 0


@dataclass(frozen=True)
class GroupLaunch:
    """How the supervisor starts the groups.

    Attributes:
      groups: how many groups.
      out: the folder of their run dirs (``group_<i>``) and logs (``group_<i>.log``).
      overrides: the ``trainers.train`` overrides every group gets (the same config).
      axis: the elastic axis.
      restarts: how many times one group is restarted before the supervisor gives up.
      processes: the ``jax.distributed`` processes of each group (1: no ``distributed.*``;
        more: each start of a group gets its own coordinator on 127.0.0.1, over gloo).
    """

    groups: int
    out: Path
    overrides: tuple[str, ...]
    axis: str = "slice"
    restarts: int = 3
    processes: int = 1

    def command(self, group: int, lighthouse: LighthouseOptions) -> list[str]:
        """The command line of `group`: the lighthouse's address and its ``min_groups`` are the
        group's too (a group commits with as few groups as the lighthouse forms a quorum of)."""
        node = f"reduction.axes.{self.axis}.elastic"
        return [
            sys.executable,
            "-m",
            "trainers.train",
            *self.overrides,
            f"{node}.group={group}",
            f"{node}.lighthouse={lighthouse.bind}",
            f"{node}.min_groups={lighthouse.min_groups}",
            f"hydra.run.dir={self.out / f'group_{group}'}",
        ]


class _Processes:
    """The processes of one start of a group, polled as one: a group of several
    ``jax.distributed`` processes cannot lose one, so when one fails the others are killed
    and the group fails with its status."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    def poll(self) -> int | None:
        """None while the group runs; 0 once every process finished; else the first failed
        process's status (the others killed)."""
        codes = [p.poll() for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def terminate(self) -> None:
        """Asks every process to stop (SIGTERM)."""
        for proc in self.procs:
            proc.terminate()

    def wait(self) -> None:
        """Waits for every process."""
        for proc in self.procs:
            proc.wait()


def _distributed(launch: GroupLaunch) -> list[list[str]]:
    """Each process's ``distributed.*`` overrides for one start of a group (none for one
    process): a fresh coordinator port on 127.0.0.1, gloo collectives."""
    if launch.processes == 1:
        return [[]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [
        "distributed.enabled=true",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        f"distributed.num_processes={launch.processes}",
        "distributed.cpu_collectives=gloo",
    ]
    return [[*common, f"distributed.process_id={i}"] for i in range(launch.processes)]


def _spawn(launch: GroupLaunch, group: int, lighthouse: LighthouseOptions) -> _Processes:
    """Starts `group`'s processes, appending to its logs (``group_<i>.log``, and
    ``group_<i>.process<k>.log`` for process k > 0); their ids in ``group_<i>.pid``."""
    procs = []
    for k, extra in enumerate(_distributed(launch)):
        name = f"group_{group}.log" if k == 0 else f"group_{group}.process{k}.log"
        with open(launch.out / name, "ab") as log_file:  # the child keeps its own
            procs.append(
                subprocess.Popen(
                    [*launch.command(group, lighthouse), *extra],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
    (launch.out / f"group_{group}.pid").write_text("".join(f"{p.pid}\n" for p in procs))
    return _Processes(procs)


def supervise(launch: GroupLaunch, lighthouse: LighthouseOptions) -> int:
    """Starts the lighthouse and the groups, restarts a group that dies; returns 0 once every
    group finished, `EXIT_PEER_LOST` if a group died more than ``restarts`` times (the others
    are stopped then)."""
    launch.out.mkdir(parents=True, exist_ok=True)
    server = start_lighthouse(lighthouse)
    procs = {g: _spawn(launch, g, lighthouse) for g in range(launch.groups)}
    restarted = dict.fromkeys(procs, 0)
    try:
        while procs:
            time.sleep(0.2)
            for g, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                if code == 0:
                    del procs[g]
                    log.info("Group %d finished.", g)
                elif restarted[g] >= launch.restarts:
                    log.error(
                        "Group %d exited %d after %d restarts; stopping.", g, code, launch.restarts
                    )
                    return EXIT_PEER_LOST
                else:
                    restarted[g] += 1
                    log.warning("Group %d exited %d; restarting it (%d).", g, code, restarted[g])
                    procs[g] = _spawn(launch, g, lighthouse)
        return 0
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait()
        server.shutdown()
