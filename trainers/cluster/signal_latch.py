"""Stop signals that arrive outside `train()`: during imports, composition, or after the run.

`trainers.cluster.preemption.StopOnSignal` handles SIGTERM / SIGINT / SIGUSR2 while `train()` runs.
Before it (Python imports JAX, Hydra composes the config) and after it (the summary is written,
JAX shuts down) the process would die silently on SIGTERM (status -15), and a SIGINT could be
swallowed by an import and the run would train to the end. `install` is the first statement
of the entry points (``python -m trainers.train``, ``python -m trainers.doctor``, and
`trainers.main` apps): from then until the process exits, a first stop signal is only
recorded here (stdlib only, so installing it costs nothing), and:

- the next `StopOnSignal` takes it over: the run stops before its first step (exit 75, nothing
  written), and so does the next job of a multirun;
- a signal that no `StopOnSignal` took over (it came after the run) is reported in one line
  by `report_unhandled` when the entry point returns; the run's own status stands;
- a second signal exits at once, with one line, as the default action would.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

#: The signals latched before `train()` runs (every value ``trainer.stop_signals`` allows).
LATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

# Process state that signal handling needs: a handler is called by the interpreter, with no
# caller to hand a value to, from before any object of the run exists until the process ends.
_pending: signal.Signals | None = None  # the first stop signal, until a StopOnSignal takes it
_installed = False  # the latch is installed once per process (every entry point asks)


def _default(sig: signal.Signals) -> Any:
    return signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL


def _handle(signum: int, frame: FrameType | None) -> None:
    del frame
    global _pending
    sig = signal.Signals(signum)
    if _pending is None:
        _pending = sig
        return
    print(f"xshard: received {sig.name} again: exiting immediately.", file=sys.stderr, flush=True)
    signal.signal(sig, _default(sig))
    signal.raise_signal(sig)


def install() -> None:
    """Latches the stop signals from now until the process exits (main thread only).

    Signals that are ignored (``SIG_IGN``, e.g. SIGINT of a background job) stay ignored.
    """
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in LATCHED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handle)
    _installed = True


def take() -> signal.Signals | None:
    """The signal recorded since the last call, if any; clears it."""
    global _pending
    sig, _pending = _pending, None
    return sig


def report_unhandled() -> None:
    """Reports, in one line on stderr, a stop signal received after the run had ended."""
    sig = take()
    if sig is not None:
        print(
            f"xshard: received {sig.name} after the run had ended; everything it wrote is "
            "complete (see its summary).",
            file=sys.stderr,
            flush=True,
        )
