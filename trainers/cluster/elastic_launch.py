"""Launching elastic replica groups: torchft's lighthouse and a local supervisor.

`serve_lighthouse` runs torchft's lighthouse (the quorum server) in this process until a
signal. `supervise` starts the lighthouse and N groups on one host, each
``python -m trainers.train <overrides> reduction.axes.<axis>.elastic.group=<i>`` with its own
run dir and log (``<out>/group_<i>/``, ``<out>/group_<i>.log``), and restarts a group that
dies (any exit but 0 and 2, a signal too) up to ``restarts`` times; the others go on. A group
refused with exit 2 (its config or command line: a restart would be refused the same way) stops
the run at once, its error line repeated. A group may be
several ``jax.distributed`` processes (``GroupLaunch.processes``): when one dies the others
are killed and the group restarts whole. Each group's process ids are in
``<out>/group_<i>.pid``. With ``standby`` (groups of one process), each group has a warm
standby (`trainers.cluster.standby`: its log ``<out>/standby_<i>.log``, Hydra's dir
``<out>/standby_<i>/``), started once the group joined its peers, which takes over when the
group dies; a fresh standby is started once it joined in turn. Used by
``python -m trainers.elastic`` (its ``--help``; docs/reductions.md).
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

from trainers.cluster.standby import JOINING, go_line
from trainers.exits import EXIT_CONFIG_ERROR, EXIT_PEER_LOST
from xshard.config.elastic_groups import DEFAULT_LIGHTHOUSE, STANDBY_FLAG

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
      restarts: how many times one group is restarted (or its standby takes over) before the
        supervisor gives up.
      processes: the ``jax.distributed`` processes of each group (1: no ``distributed.*``;
        more: each start of a group gets its own coordinator on 127.0.0.1, over gloo).
      standby: keep a warm standby per group (`trainers.cluster.standby`; groups of one
        process), started once the group joined its peers; it takes over when the group dies.
    """

    groups: int
    out: Path
    overrides: tuple[str, ...]
    axis: str = "slice"
    restarts: int = 3
    processes: int = 1
    standby: bool = False

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

    def standby_command(self, group: int, lighthouse: LighthouseOptions) -> list[str]:
        """The command line of `group`'s standby: the group's, its outputs in the group's run
        dir (``paths.output_dir``), Hydra's own (config dump, log file until it takes over)
        in ``standby_<i>``."""
        return [
            *self.command(group, lighthouse),
            f"reduction.axes.{self.axis}.{STANDBY_FLAG}=true",
            f"paths.output_dir={self.out / f'group_{group}'}",
            f"hydra.run.dir={self.out / f'standby_{group}'}",
        ]

    def log(self, group: int) -> Path:
        """The log of `group` (its stdout and stderr, appended by each of its processes)."""
        return self.out / f"group_{group}.log"


class _Processes:
    """The processes of one start of a group, polled as one: a group of several
    ``jax.distributed`` processes cannot lose one, so when one fails the others are killed
    and the group fails with its status."""

    #: Nothing to tell it on stdin (a standby that took over keeps its pipe unread).
    stdin = None

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs

    @property
    def pid(self) -> int:
        """The first process's id."""
        return self.procs[0].pid

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

    def wait(self, timeout: float | None = None) -> None:
        """Waits for every process (`timeout` seconds each at most: TimeoutExpired)."""
        for proc in self.procs:
            proc.wait(timeout)

    def kill(self) -> None:
        """Kills every process still there."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


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
        name = launch.log(group) if k == 0 else launch.out / f"group_{group}.process{k}.log"
        with open(name, "ab") as log_file:  # the child keeps its own
            procs.append(
                subprocess.Popen(
                    [*launch.command(group, lighthouse), *extra],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
    (launch.out / f"group_{group}.pid").write_text("".join(f"{p.pid}\n" for p in procs))
    return _Processes(procs)


def _spawn_standby(
    launch: GroupLaunch, group: int, lighthouse: LighthouseOptions
) -> subprocess.Popen:
    """Starts `group`'s standby, its stdin a pipe from here, its log ``standby_<i>.log``, its
    process id in ``standby_<i>.pid``."""
    with open(launch.out / f"standby_{group}.log", "ab") as log_file:
        proc = subprocess.Popen(
            launch.standby_command(group, lighthouse),
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    (launch.out / f"standby_{group}.pid").write_text(f"{proc.pid}\n")
    return proc


def _stop(procs: list[tuple[_Processes | subprocess.Popen, bool]]) -> None:
    """Stops each process (with whether it is a waiting standby): a standby by closing its
    stdin (it exits, writing nothing), a group by SIGTERM; killed if still there 30 s later."""
    for proc, standby in procs:
        if proc.stdin is not None:
            proc.stdin.close()
        if not standby:
            proc.terminate()
    for proc, _ in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class _Group:
    """One group under the supervisor: its processes, where in its log their lines start,
    how many times it was replaced, and its standby (None: none yet, or taken over)."""

    proc: _Processes
    log_from: int = 0
    restarts: int = 0
    standby: subprocess.Popen | None = None


def _joined(launch: GroupLaunch, group: int, state: _Group) -> bool:
    """Whether the group's current process joined its peers (compiled): its log says so."""
    with open(launch.log(group), "rb") as f:
        f.seek(state.log_from)
        return JOINING.encode() in f.read()


def _replace(
    launch: GroupLaunch, lighthouse: LighthouseOptions, group: int, state: _Group, code: int
) -> None:
    """The group's process exited with `code`: its standby takes over (told on its stdin),
    else a new process is started."""
    state.restarts += 1
    state.log_from = launch.log(group).stat().st_size
    standby, state.standby = state.standby, None
    if standby is not None and standby.poll() is None:
        try:
            assert standby.stdin is not None
            standby.stdin.write(go_line(launch.log(group).resolve()))
            standby.stdin.flush()
            log.warning(
                "Group %d exited %d; its standby took over (pid %d).", group, code, standby.pid
            )
            state.proc = _Processes([standby])
            (launch.out / f"group_{group}.pid").write_text(f"{standby.pid}\n")
            return
        except BrokenPipeError:  # it died in between: a fresh start
            standby.wait()
    log.warning("Group %d exited %d; restarting it (%d).", group, code, state.restarts)
    state.proc = _spawn(launch, group, lighthouse)


def last_line(path: Path) -> str:
    """The last line of the log at `path` (a refused run's is its one-line error), else the
    path itself."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    return lines[-1] if lines else f"see {path}"


def _exit_on_signal(signum: int, _: Any) -> None:
    """SIGTERM or SIGINT to the supervisor: it exits (128 + the signal) after stopping its
    groups and standbys (`supervise`'s ``finally``)."""
    raise SystemExit(128 + signum)


def supervise(launch: GroupLaunch, lighthouse: LighthouseOptions) -> int:
    """Starts the lighthouse and the groups, restarts a group that dies (or its standby takes
    over); returns 0 once every group finished, `EXIT_PEER_LOST` if a group died more than
    ``restarts`` times, `EXIT_CONFIG_ERROR` at once if a group was refused (its config or
    command line); the others are stopped then, as on SIGTERM or SIGINT."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    launch.out.mkdir(parents=True, exist_ok=True)
    server = start_lighthouse(lighthouse)
    groups = {g: _Group(_spawn(launch, g, lighthouse)) for g in range(launch.groups)}
    try:
        while groups:
            time.sleep(0.2)
            for g, state in list(groups.items()):
                code = state.proc.poll()
                if code is None:
                    if launch.standby and state.standby is None and _joined(launch, g, state):
                        state.standby = _spawn_standby(launch, g, lighthouse)
                elif code == 0:
                    del groups[g]
                    log.info("Group %d finished.", g)
                    if state.standby is not None:
                        _stop([(state.standby, True)])
                elif code == EXIT_CONFIG_ERROR:
                    log.error(
                        "Group %d exited %d, refused: %s; not restarted (it would be refused "
                        "again); stopping.", g, code, last_line(launch.log(g))
                    )  # fmt: skip
                    return EXIT_CONFIG_ERROR
                elif state.restarts >= launch.restarts:
                    log.error(
                        "Group %d exited %d after %d restarts; stopping.", g, code, launch.restarts
                    )
                    return EXIT_PEER_LOST
                else:
                    _replace(launch, lighthouse, g, state, code)
        return 0
    finally:
        waiting = [(s.standby, True) for s in groups.values() if s.standby is not None]
        _stop(waiting + [(s.proc, False) for s in groups.values()])
        server.shutdown()
