"""One run over several processes: forming the cluster, agreeing on start-up, leaving together.

`join_cluster` calls ``jax.distributed.initialize`` (``distributed.enabled=true``; with the
other ``distributed.*`` keys null JAX detects SLURM, TPU pods and the other clusters it
knows) and returns a `Cluster`: this process's index, the process count, and small
collectives over JAX's distributed key-value store (`Cluster.all_gather`,
`Cluster.broadcast`, `Cluster.agreed`), used at start-up only, never per step. It also starts
the `trainers.cluster.watchdog.PeerWatchdog`, so that a lost process ends the others within
``distributed.heartbeat_timeout_s``. The join itself is waited for in bounded time
(`init_distributed`): a process that cannot reach the coordinator, or a cluster that does not
form, fails with one line naming ``distributed.coordinator_address`` (exit status 2) before
JAX's own deadline would abort the process with a C++ stack trace.

Leaving: a process that fails alone must not wait in JAX's shutdown barrier for peers that
will never get there. `exit_process` tells the peers this process's exit status (the watchdog
ends them if it is an error), then ends the process: through the normal interpreter exit
(JAX's shutdown barrier) when every process ends the same way (done, preempted), else at
once. Exit statuses are those of `trainers.train`, plus `EXIT_PEER_LOST`.

A single process (``distributed.enabled=false``) gets a `Cluster` of one: every collective
returns this process's own value and nothing else happens.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from trainers.cluster.leaving import AGREED_EXITS, EXIT_GRACE_S, KV_PREFIX, flush_and_exit
from trainers.errors import PeerError
from xshard.config.nodes import shown
from xshard.errors import ConfigError

if TYPE_CHECKING:
    from trainers.cluster.watchdog import PeerWatchdog
    from trainers.config import DistributedOptions

logger = logging.getLogger(__name__)

#: Seconds JAX's own join deadline lies beyond ``distributed.initialization_timeout_s``: when
#: it passes, JAX ends the process (SIGABRT and a C++ stack trace), so xshard's wait, which
#: ends with one line naming the key, must end first (`init_distributed`).
JAX_JOIN_MARGIN_S = 30
#: How often a joining process checks on the join and tries to reach the coordinator.
PROBE_EVERY_S = 0.5

_join_abandoned = False  # JAX's join still runs in a thread: `exit_process` exits at once


class Cluster:
    """The processes of this run, as seen from one of them.

    Args:
      index: this process's index (``jax.process_index()``).
      count: the number of processes.
      client: JAX's distributed runtime client (None for a single process).
      timeout_s: how long a collective waits for the slowest process.
      hosts: "host:pid" of every process, for messages.
    """

    def __init__(
        self,
        index: int = 0,
        count: int = 1,
        client: Any = None,
        timeout_s: float = 300.0,
        hosts: list[str] | None = None,
    ):
        self.index, self.count, self.client, self.timeout_s = index, count, client, timeout_s
        self.hosts = hosts or [f"{socket.gethostname()}:{os.getpid()}"] * count
        self.watchdog: PeerWatchdog | None = None

    @property
    def lead(self) -> bool:
        """Whether this is process 0, the one that writes logs, events and the config dump."""
        return self.index == 0

    def name(self, index: int) -> str:
        """The process named for messages: ``process 1 (host:pid)``."""
        return f"process {index} ({self.hosts[index]})"

    # ------------------------------------------------------------------ collectives

    def all_gather(self, name: str, value: Any) -> list[Any]:
        """Every process's `value` (JSON-able), in process order; `name` is unique per call.

        Raises:
          PeerError: if a process does not reach this call within `timeout_s`.
        """
        if self.count == 1:
            return [value]
        key = f"{KV_PREFIX}{name}"
        self.client.key_value_set(f"{key}/{self.index}", json.dumps(value))
        return [json.loads(self._get(f"{key}/{i}", name, i)) for i in range(self.count)]

    def broadcast(self, name: str, value: Any) -> Any:
        """Process 0's `value` (JSON-able), on every process; `name` is unique per call.

        Raises:
          PeerError: if process 0 does not reach this call within `timeout_s`.
        """
        if self.count == 1:
            return value
        key = f"{KV_PREFIX}{name}"
        if self.lead:
            self.client.key_value_set(key, json.dumps(value))
            return value
        return json.loads(self._get(key, name, 0))

    def _get(self, key: str, name: str, index: int) -> str:
        try:
            return self.client.blocking_key_value_get(key, int(self.timeout_s * 1000))
        except Exception as e:  # jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED
            raise PeerError(
                f"{self.name(index)} did not reach '{name}' within "
                f"distributed.initialization_timeout_s={self.timeout_s:g} s "
                f"({_first_line(e)}); see that process's log."
            ) from e

    @contextlib.contextmanager
    def agreed(self, name: str) -> Iterator[None]:
        """Runs the block on every process; an error on any process is raised on all.

        The process that failed raises its own error; the others raise `PeerError` naming
        it. Use around start-up steps that may fail on one process only (a directory one
        process cannot see), so that no process goes on to wait for the failed one.

        Raises:
          Exception: the block's own error, or `PeerError` for another process's.
        """
        error: Exception | None = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
        problems = self.all_gather(f"agree/{name}", None if error is None else _one_line(error))
        if error is not None:
            raise error
        self.raise_for(problems, name)

    def raise_for(self, problems: list[str | None], what: str) -> None:
        """Raises `PeerError` for the first process whose entry in `problems` is not None.

        Raises:
          PeerError: naming the process, `what` it was doing and its message.
        """
        failed = [(i, p) for i, p in enumerate(problems) if p is not None]
        if failed:
            i, problem = failed[0]
            more = f" ({len(failed) - 1} more processes failed too)" if len(failed) > 1 else ""
            raise PeerError(f"{self.name(i)} failed at {what}: {problem}{more}")

    # ------------------------------------------------------------------ leaving

    def announce_exit(self, code: int) -> None:
        """Tells the peers' watchdogs that this process ends with `code`; stops its own."""
        if self.watchdog is not None:
            self.watchdog.announce_exit(code)

    def wait_for_exits(self, timeout_s: float) -> None:
        """Waits until every other process announced its exit, or `timeout_s` passed."""
        if self.watchdog is not None:
            self.watchdog.wait_for_exits(timeout_s)


_SINGLE = Cluster()
_ACTIVE: Cluster = _SINGLE


def current() -> Cluster:
    """The cluster `join_cluster` formed in this process (one process if none)."""
    return _ACTIVE


def join_cluster(opts: DistributedOptions) -> Cluster:
    """Forms the cluster (``distributed.enabled=true``) and starts the peer watchdog.

    Call before any JAX computation: it does not initialise JAX's backends, so the devices
    can still be configured afterwards (`xshard.mesh.configure_devices`).

    Args:
      opts: the ``distributed`` config node.

    Returns:
      The `Cluster` (a single process when ``distributed.enabled=false``).

    Raises:
      ConfigError: if JAX cannot form the cluster from these settings (e.g. nothing to
        detect it from), or a process cannot join it within the initialisation timeout.
    """
    global _ACTIVE
    if not opts.enabled:
        return _ACTIVE
    from jax._src import distributed

    from trainers.cluster.watchdog import PeerWatchdog

    init_distributed(opts)
    state = distributed.global_state
    cluster = Cluster(
        index=state.process_id,
        count=state.num_processes,
        client=state.client,
        timeout_s=opts.initialization_timeout_s,
    )
    cluster.hosts = cluster.all_gather("hosts", f"{socket.gethostname()}:{os.getpid()}")
    if cluster.count > 1:
        cluster.watchdog = PeerWatchdog(
            state.client,
            cluster.index,
            cluster.count,
            timeout_s=opts.heartbeat_timeout_s,
            hosts=cluster.hosts,
        )
        cluster.watchdog.start()
    _ACTIVE = cluster
    return cluster


def detected_cluster() -> str:
    """The cluster JAX's auto-detection would use here ("slurm", "gcetpu", ...), or "none"."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
            return env.name or env.__name__
    return "none (set distributed.coordinator_address, num_processes and process_id)"


def jax_heartbeat_timeout_s(heartbeat_timeout_s: float) -> int:
    """JAX's own heartbeat timeout: a backstop well after xshard's watchdog has reported."""
    return int(2 * heartbeat_timeout_s + 5)


def init_distributed(opts: DistributedOptions) -> None:
    """``jax.distributed.initialize`` for multi-process runs (``distributed.enabled=true``).

    One process per host (or per accelerator, as SLURM's detection does); on TPU pods and
    SLURM the arguments can stay null (JAX detects them). ``distributed.cpu_collectives=gloo``
    joins CPU-only processes, as the tests do.

    The join runs in a thread, and this process waits for it at most
    ``distributed.initialization_timeout_s`` (process 0, which hosts the coordinator,
    `EXIT_GRACE_S` longer, so that the processes connected to it fail first). JAX's own join
    deadline lies `JAX_JOIN_MARGIN_S` beyond: when it passes, JAX ends the process itself
    (SIGABRT, exit 134, a C++ stack trace). Meanwhile a process other than 0 tries to reach the
    coordinator's port, so that the error can say whether anything answered there.

    Raises:
      ConfigError: if JAX cannot form the cluster from these settings (e.g. nothing to
        detect it from), or not every process joined within the initialisation timeout:
        naming ``distributed.coordinator_address`` and its value. A join still running in
        JAX is abandoned: `exit_process` then ends the process at once.
    """
    if not opts.enabled:
        return
    import jax

    if opts.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", opts.cpu_collectives)
    # JAX's preemption service would take SIGTERM over (a C++ handler replacing
    # `StopOnSignal`'s) and agree on SIGTERM only; the trainer agrees on every stop signal
    # within its steps instead (`trainers.core.trainer.StopVote`).
    jax.config.update("jax_enable_preemption_service", False)
    error = _join(
        opts,
        coordinator_address=opts.coordinator_address,
        num_processes=opts.num_processes,
        process_id=opts.process_id,
        initialization_timeout=int(opts.initialization_timeout_s) + JAX_JOIN_MARGIN_S,
        heartbeat_timeout_seconds=jax_heartbeat_timeout_s(opts.heartbeat_timeout_s),
    )
    if error is None:
        return
    if isinstance(error, ValueError | TypeError):  # "coordinator_address should be defined."
        raise ConfigError(
            f"distributed.enabled=true: JAX could not set up the cluster ({error}). Outside a "
            "cluster JAX detects (TPU pod, SLURM), set distributed.coordinator_address, "
            "distributed.num_processes and distributed.process_id."
        ) from error
    # jax.errors.JaxRuntimeError: a peer or the coordinator missing (when JAX raises it
    # rather than ending the process)
    raise ConfigError(
        f"distributed.enabled=true: the cluster did not form within "
        f"distributed.initialization_timeout_s={opts.initialization_timeout_s:g} s "
        f"({_first_line(error)}). Start every process (distributed.num_processes of them) "
        "with the same distributed.coordinator_address, reachable from all."
    ) from error


def _join(opts: DistributedOptions, **kwargs: Any) -> BaseException | None:
    """``jax.distributed.initialize(**kwargs)`` in a thread, waited for in bounded time.

    Returns:
      The error ``initialize`` raised, or None once it returned.

    Raises:
      ConfigError: if it is still running after the wait (see `init_distributed`).
    """
    global _join_abandoned
    import jax
    from jax._src import distributed

    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            jax.distributed.initialize(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome.append(e)
        else:
            outcome.append(None)

    thread = threading.Thread(target=join, name="xshard-join", daemon=True)
    start = time.monotonic()
    thread.start()
    probe = _CoordinatorProbe()
    state = distributed.global_state
    while True:
        # Explicit values, else the ones JAX detected (set before it creates its client).
        detected = state.client is not None
        pid = (
            opts.process_id
            if opts.process_id is not None
            else (state.process_id if detected else None)
        )
        address = opts.coordinator_address or (state.coordinator_address if detected else None)
        wait = opts.initialization_timeout_s + (EXIT_GRACE_S if pid in (0, None) else 0.0)
        left = start + wait - time.monotonic()
        if left <= 0:
            break
        if pid not in (0, None) and address:
            probe.poke(address)
        thread.join(min(PROBE_EVERY_S, left))
        if not thread.is_alive():
            return outcome[0] if outcome else None
    _join_abandoned = True
    # JAX's exit-time shutdown would wait on the join (or end the process with its own abort):
    # a process that does not end through `exit_process` (a multirun's job) ends here.
    from trainers.errors import EXIT_CONFIG_ERROR

    atexit.register(flush_and_exit, EXIT_CONFIG_ERROR)
    count = opts.num_processes or (state.num_processes if detected else None)
    raise ConfigError(_join_timeout_message(opts, pid, count, address, probe))


def _join_timeout_message(
    opts: DistributedOptions,
    pid: int | None,
    count: int | None,
    address: str | None,
    probe: _CoordinatorProbe,
) -> str:
    """The one line of a join that did not complete in time (`_join`)."""
    within = f"within distributed.initialization_timeout_s={opts.initialization_timeout_s:g} s"
    if opts.num_processes:
        processes = f"all distributed.num_processes={count} processes"
    else:
        processes = f"all {count} processes" if count else "all the processes"
    if address is None or pid is None:
        return (
            f"distributed.enabled=true: the cluster did not form {within}: JAX was still "
            f"detecting it ({detected_cluster()}). Set distributed.coordinator_address, "
            "distributed.num_processes and distributed.process_id outside a cluster JAX detects."
        )
    key = (
        f"distributed.coordinator_address={shown(address)}"
        if opts.coordinator_address
        else f"the coordinator JAX detected ({address}; distributed.coordinator_address=null)"
    )
    if pid != 0 and not probe.answered:
        return (
            f"{key}: nothing answered there {within} ({probe.error or 'no answer'}): process "
            f"{pid} could not reach process 0's coordinator. It must be process 0's host:port, "
            "the same on every process and reachable from this host: check it, and that "
            "process 0 is running."
        )
    if pid != 0:
        return (
            f"{key}: the cluster did not form {within}: process {pid} reached that address, but "
            f"not {processes} joined there. Start every process with the same "
            "distributed.coordinator_address (process 0's host:port) and num_processes, and a "
            "distinct distributed.process_id."
        )
    return (
        f"{key}: the cluster did not form {within}: not {processes} joined "
        "process 0's coordinator there. Start every process with this "
        "distributed.coordinator_address (process 0's host:port, reachable from every host) "
        "and a distinct distributed.process_id."
    )


class _CoordinatorProbe:
    """Tries to open a TCP connection to the coordinator, for the message of a failed join."""

    def __init__(self) -> None:
        self.answered = False
        self.error: str | None = None
        self._next = 0.0

    def poke(self, address: str) -> None:
        """One connection attempt to `address` (host:port) if due and none answered yet."""
        now = time.monotonic()
        if self.answered or now < self._next:
            return
        self._next = now + PROBE_EVERY_S
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                self.answered = True
        except socket.gaierror as e:
            self.error = f"cannot resolve {host}: {e.strerror or e}"
        except (OSError, ValueError) as e:
            self.error = getattr(e, "strerror", None) or _first_line(e) or type(e).__name__


def exit_process(code: int) -> NoReturn:
    """Ends this process with `code`, telling the other processes of the run first.

    One process: ``sys.exit(code)``. Several: the peers' watchdogs learn the status; a status
    every process reaches together (`AGREED_EXITS`) ends through the interpreter's normal exit
    (JAX's shutdown barrier waits for all); any other ends at once (``os._exit``, after the
    logs are flushed), so that it never waits for peers that may be stuck: process 0, which
    hosts JAX's coordinator, first gives its peers `EXIT_GRACE_S` to leave.
    """
    cluster = _ACTIVE
    if _join_abandoned:  # JAX's join is still running: a normal exit would wait for it
        flush_and_exit(code)
    if cluster.count == 1:
        sys.exit(code)
    cluster.announce_exit(code)
    if code in AGREED_EXITS:
        sys.exit(code)
    if cluster.lead:
        cluster.wait_for_exits(EXIT_GRACE_S + 3.0)
    flush_and_exit(code)


def report_unexpected(error: BaseException) -> None:
    """In a multi-process run, logs `error`'s traceback and exits 1 (see `exit_process`).

    A collective that failed on its connection (gloo: "Connection closed by peer") means a
    peer is gone:
    the watchdog is given the time to find it and end the process with its one-line report and
    `EXIT_PEER_LOST` first. With one process this returns, and the caller re-raises
    (Hydra prints the traceback).
    """
    cluster = _ACTIVE
    if cluster.count == 1:
        return
    import jax

    lost_peer = re.search(r"gloo|connection|socket|peer|unavailable", str(error), re.IGNORECASE)
    if isinstance(error, jax.errors.JaxRuntimeError) and lost_peer and cluster.watchdog:
        wait = cluster.watchdog.timeout_s + EXIT_GRACE_S + 2 * cluster.watchdog.poll_s
        logger.error(
            "A collective failed (%s): waiting up to %.0f s for the peer watchdog to find the "
            "lost process.",
            _first_line(error),
            wait,
        )
        time.sleep(wait)  # the watchdog ends the process meanwhile if a peer is lost
    logger.error("Unexpected error: %s", _one_line(error), exc_info=error)
    exit_process(1)


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return text[:300]


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
