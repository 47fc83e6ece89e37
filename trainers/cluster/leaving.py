"""How a process of a run leaves: the facts `multihost` and its `watchdog` share.

A process that fails alone must not wait in JAX's shutdown barrier for peers that will never
get there, so it flushes what it wrote and ends at once (`flush_and_exit`); its peers learn its
exit status through JAX's key-value store, under `KV_PREFIX`. Nor must a process wait for a
thread of its own that still waits on the network (`held_by_threads`: a torchft quorum that
an elastic group left on a stop request runs until ``quorum_timeout_s``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

#: Exit statuses every process of a run reaches together (done, preempted after saving).
AGREED_EXITS = (0, 75)
#: How long a process whose peer failed gives its own main thread to fail the same way (an
#: error every process raises) before it reports the peer as lost. Process 0, which hosts
#: JAX's coordinator, waits a little longer than that for its peers to leave.
EXIT_GRACE_S = 5.0
#: Key prefix of xshard's entries in JAX's key-value store.
KV_PREFIX = "xshard/"
#: Names (prefixes) of threads that may still wait on the network once the run has ended, up to
#: their own timeout: torchft's quorum (its ``Manager``'s executor), when an elastic group left
#: a round on a stop request (`trainers.cluster.torchft_group`).
LEFT_WAITING = ("async_quorum",)


def flush_and_exit(code: int) -> NoReturn:
    """Flushes stdout, stderr and the log handlers, then ``os._exit(code)``."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def held_by_threads() -> bool:
    """Whether a normal exit would wait for one of the `LEFT_WAITING` threads, still running
    (the interpreter joins every thread that is not a daemon before it exits)."""
    return any(t.name.startswith(LEFT_WAITING) and t.is_alive() for t in threading.enumerate())
