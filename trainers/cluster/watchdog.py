"""A lost process ends the run's other processes in bounded time, with one line naming it.

Without this, a process whose peer died (``kill -9``, a crashed host, an out-of-memory kill)
waits in its next collective: gloo and XLA have no timeout there, and JAX's distributed
service only aborts the survivors, with a stack trace, after its own heartbeat timeout.

`PeerWatchdog` is a daemon thread in every process of a multi-process run. Every
`poll_s` it bumps this process's counter in JAX's key-value store and reads the others'
(one RPC each; the main thread is not involved, so a process blocked in a collective or a
long compilation keeps beating). A peer whose counter has not moved for ``timeout_s`` is
lost; a peer that announced an error exit (`announce_exit`) is lost after `grace_s` unless
this process announced its own exit by then (an error every process raises, such as a
non-finite loss, ends each with its own status). Then the watchdog logs one line, e.g.::

    xshard: error: lost process 1 (host-b:4242): no heartbeat for 30 s (killed, crashed or
    unreachable). Last complete checkpoint: step 200 in /runs/a/checkpoints. Restart all 2
    processes with the same command to resume.

and ends the process with `EXIT_PEER_LOST` at once (``os._exit``: a checkpoint being written
stays an unfinished temporary folder, which the next run removes; the last complete one
stays valid). JAX's own heartbeat timeout is set well beyond ``timeout_s``
(`trainers.cluster.join.jax_heartbeat_timeout_s`) so that this line comes first. When process 0
dies, JAX's coordinator goes with it and JAX aborts the others itself, at once (exit status
134, "the leader task was preempted/died"): see docs/multihost.md.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from trainers.cluster.leaving import AGREED_EXITS, EXIT_GRACE_S, KV_PREFIX, flush_and_exit
from trainers.exits import EXIT_PEER_LOST

logger = logging.getLogger(__name__)

HEARTBEAT_PREFIX = f"{KV_PREFIX}heartbeat/"
_EXIT = "exit "


class PeerWatchdog:
    """Heartbeats of one process and watch over the others (see the module docstring).

    Args:
      client: JAX's distributed runtime client.
      index: this process's index.
      count: the number of processes.
      timeout_s: a peer whose heartbeat has not moved for this long is lost.
      hosts: "host:pid" of every process, for the message.
      poll_s: heartbeat period.
      grace_s: how long a peer's error exit is given before this process ends too.
      on_lost: called with the message when a peer is lost (default: log it, print it on
        stderr and ``os._exit(EXIT_PEER_LOST)``).
    """

    def __init__(
        self,
        client: Any,
        index: int,
        count: int,
        *,
        timeout_s: float,
        hosts: list[str] | None = None,
        poll_s: float = 1.0,
        grace_s: float = EXIT_GRACE_S,
        on_lost: Callable[[str], Any] | None = None,
    ):
        self.client, self.index, self.count = client, index, count
        self.timeout_s, self.poll_s, self.grace_s = timeout_s, min(poll_s, timeout_s / 4), grace_s
        self.hosts = hosts or ["?"] * count
        self.on_lost = on_lost or _report_and_exit
        self._checkpoint_dir: str | None = None  # for the message: `name_checkpoints`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xshard-peer-watchdog", daemon=True)
        self._exits: dict[int, int] = {}

    def start(self) -> None:
        """Starts beating and watching."""
        self._beat(0)
        self._thread.start()

    def announce_exit(self, code: int) -> None:
        """Stops watching and tells the peers this process ends with status `code`."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s)
        try:
            self.client.key_value_set(self._key(self.index), f"{_EXIT}{code}", allow_overwrite=True)
        except Exception as e:  # the coordinator may be gone already
            logger.debug("Could not announce exit %d: %s", code, e)

    def wait_for_exits(self, timeout_s: float) -> None:
        """Waits until every peer announced its exit (or is gone), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                entries = dict(self.client.key_value_dir_get(HEARTBEAT_PREFIX))
            except Exception:  # nothing left to wait for
                return
            peers = [self._key(i) for i in range(self.count) if i != self.index]
            if all(str(entries.get(k, "")).startswith(_EXIT) for k in peers):
                return
            time.sleep(0.1)

    # ------------------------------------------------------------------ the thread

    def _key(self, index: int) -> str:
        return f"{HEARTBEAT_PREFIX}{index}"

    def _beat(self, n: int) -> None:
        self.client.key_value_set(self._key(self.index), str(n), allow_overwrite=True)

    def _run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {
            i: (None, start) for i in range(self.count) if i != self.index
        }
        failed_since: dict[int, float] = {}
        n = 0
        while not self._stop.wait(self.poll_s):
            n += 1
            try:
                self._beat(n)
                entries = dict(self.client.key_value_dir_get(HEARTBEAT_PREFIX))
            except Exception as e:  # the coordinator is unreachable
                if self._stop.is_set():
                    return
                self._lost(
                    f"lost the coordinator, {self._name(0)}: {_first_line(e)}"
                    if self.index != 0
                    else f"lost JAX's distributed service: {_first_line(e)}"
                )
                return
            now = time.monotonic()
            for peer, (value, since) in seen.items():
                current = entries.get(self._key(peer))
                if current is not None and current.startswith(_EXIT):
                    code = int(current[len(_EXIT) :])
                    self._exits[peer] = code
                    if code in AGREED_EXITS:
                        continue
                    first = failed_since.setdefault(peer, now)
                    if now - first >= self.grace_s and not self._stop.is_set():
                        self._lost(
                            f"lost {self._name(peer)}: it exited with status {code} (see its "
                            "log); this process cannot go on without it"
                        )
                        return
                    continue
                if current != value:
                    seen[peer] = (current, now)
                elif now - since >= self.timeout_s and not self._stop.is_set():
                    self._lost(
                        f"lost {self._name(peer)}: no heartbeat for {now - since:.0f} s "
                        f"(distributed.heartbeat_timeout_s={self.timeout_s:g}; killed, "
                        "crashed or unreachable)"
                    )
                    return

    def _name(self, index: int) -> str:
        return f"process {index} ({self.hosts[index]})"

    def name_checkpoints(self, checkpoint_dir: str) -> None:
        """Names the run's checkpoint dir (process 0's, known once the processes shared their
        dirs) in the report of a lost process, with its last complete step."""
        self._checkpoint_dir = checkpoint_dir

    def _lost(self, what: str) -> None:
        from trainers.checkpoint.io import complete_steps

        where = ""
        if self._checkpoint_dir is not None:
            try:
                done = complete_steps(self._checkpoint_dir)
            except Exception:  # the message matters more
                done = []
            where = (
                f" Last complete checkpoint: step {done[-1]} in {self._checkpoint_dir}."
                if done
                else f" No complete checkpoint in {Path(self._checkpoint_dir)} yet."
            )
        # Process 0 waits for its peers' exits before it takes the coordinator down.
        with contextlib.suppress(Exception):  # the coordinator may be gone
            self.client.key_value_set(
                self._key(self.index), f"{_EXIT}{EXIT_PEER_LOST}", allow_overwrite=True
            )
        self.on_lost(
            f"{what[0].upper()}{what[1:]}.{where} Restart all {self.count} processes with the "
            "same command to resume."
        )


def _report_and_exit(message: str) -> NoReturn:
    logger.error("%s", message)
    print(f"xshard: error: {message}", file=sys.stderr)
    flush_and_exit(EXIT_PEER_LOST)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]
