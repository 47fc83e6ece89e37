"""One run over several processes: forming the cluster, agreeing on start-up, leaving together.

`join_cluster` calls ``jax.distributed.initialize`` (``distributed.enabled=true``; with the
other ``distributed.*`` keys null JAX detects SLURM, TPU pods and the other clusters it
knows) and returns a `Cluster`: this process's index, the process count, and small
collectives over JAX's distributed key-value store (`Cluster.all_gather`,
`Cluster.broadcast`, `Cluster.agreed`), used at start-up (and by the eval step's batch count,
`trainers.hooks.eval_agreement`), never per step. It also starts
the `trainers.cluster.watchdog.PeerWatchdog`, so that a lost process ends the others within
``distributed.heartbeat_timeout_s``. The join itself is waited for in bounded time
(`trainers.cluster.join`): a process that cannot reach the coordinator, or a cluster that does not
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

import contextlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from trainers.cluster import join
from trainers.cluster.join import init_distributed
from trainers.cluster.leaving import (
    AGREED_EXITS,
    EXIT_GRACE_S,
    KV_PREFIX,
    flush_and_exit,
    held_by_threads,
)
from trainers.exits import PeerError

if TYPE_CHECKING:
    from trainers.cluster.watchdog import PeerWatchdog
    from trainers.config import DistributedOptions

logger = logging.getLogger(__name__)


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
                f"({join.first_line(e)}); see that process's log."
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
        except Exception as e:  # re-raised below, after the others know
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
# Process state: JAX joins a process to one cluster once (`jax.distributed` is process-global),
# so every later job of a multirun, and the exit after a failure, use the one it joined.
_ACTIVE: Cluster = _SINGLE


def current() -> Cluster:
    """The cluster `join_cluster` formed in this process (one process if none)."""
    return _ACTIVE


def join_cluster(opts: DistributedOptions) -> Cluster:
    """Forms the cluster (``distributed.enabled=true``) and starts the peer watchdog.

    Call before any JAX computation: it does not initialise JAX's backends, so the devices
    can still be configured afterwards (`xshard.mesh.build.configure_devices`).

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


def exit_process(code: int) -> NoReturn:
    """Ends this process with `code`, telling the other processes of the run first.

    One process: ``sys.exit(code)``, or ``os._exit`` after the logs are flushed where a thread
    a normal exit would join still waits (`leaving.held_by_threads`). Several: the peers'
    watchdogs learn the status; a status
    every process reaches together (`AGREED_EXITS`) ends through the interpreter's normal exit
    (JAX's shutdown barrier waits for all); any other ends at once (``os._exit``, after the
    logs are flushed), so that it never waits for peers that may be stuck: process 0, which
    hosts JAX's coordinator, first gives its peers `EXIT_GRACE_S` to leave.
    """
    cluster = _ACTIVE
    if join.abandoned():  # JAX's join is still running: a normal exit would wait for it
        flush_and_exit(code)
    if cluster.count == 1:
        if held_by_threads():  # a torchft quorum left waiting: a normal exit would wait too
            flush_and_exit(code)
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
            join.first_line(error),
            wait,
        )
        time.sleep(wait)  # the watchdog ends the process meanwhile if a peer is lost
    logger.error("Unexpected error: %s", _one_line(error), exc_info=error)
    exit_process(1)


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
