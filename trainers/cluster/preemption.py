"""SIGTERM / SIGINT / SIGUSR2 as a request to stop cleanly: finish the step, checkpoint, exit 75.

Preemptible machines (TPU spot VMs, Kubernetes, Slurm) send SIGTERM some seconds before they
kill a job; Ctrl-C sends SIGINT; SLURM jobs submitted through submitit get SIGUSR2 some
time before their time limit. ``trainer.stop_signals`` lists the signals handled (default
all three). `train.py` installs `StopOnSignal` when `train()` starts and takes over a signal
that `trainers.cluster.signal_latch` recorded before (during imports or composition), so the first
such signal at any time, start-up included, only sets a flag:
`Trainer.fit(should_stop=...)` polls it before the first step and after every step, so the run
ends with reason "stopped", its checkpoint hook saves that step, and `train.py` exits with
`EXIT_PREEMPTED`. A signal during start-up (compilation, restore) stops the run before its
first step, with nothing written. A second signal is handled as if the handlers were never
installed (SIGTERM kills the process, SIGINT raises KeyboardInterrupt): the previous
checkpoint stays valid, as after `kill -9`.

Python runs signal handlers in the main thread between bytecodes: a signal that arrives while
the main thread waits on the device (compilation, a long step) is seen when that wait ends.
The handler never raises, so it cannot be lost the way an exception raised inside a callback
(e.g. a garbage-collection callback) is.

With several processes the flag is one process's vote: `Trainer.fit` folds it into the steps
so that every process stops after the same step (`trainers.core.trainer.StopVote`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any, Self

from trainers.exits import Preempted

logger = logging.getLogger(__name__)


DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


def stop_signals(names: Sequence[str]) -> tuple[signal.Signals, ...]:
    """The signals named by ``trainer.stop_signals`` (checked by
    `trainers.config.TrainerOptions`: names of `trainers.config.run.STOP_SIGNALS`)."""
    return tuple(signal.Signals[name] for name in names)


def _raise_default(sig: signal.Signals) -> None:
    """Delivers `sig` with its default action (SIGINT: KeyboardInterrupt; SIGTERM: death)."""
    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.raise_signal(sig)


class StopOnSignal:
    """Context manager that records the first stop signal instead of dying on it.

    Use the instance as the `should_stop` callable of `Trainer.fit`. On exit the previous
    handlers are restored. Signals that were ignored (``SIG_IGN``, e.g. SIGINT of a background
    job) stay ignored. Outside the main thread no handler can be installed: a warning is
    logged and the instance never requests a stop.

    Args:
      signals: the signals to catch.
    """

    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_SIGNALS):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __call__(self) -> bool:
        """True once a stop signal has been received."""
        return self.received is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the received signal ("SIGTERM"), or None."""
        return None if self.received is None else self.received.name

    def stopped_during_start_up(
        self, start_step: int, *, by: str | None = None, signal_name: str | None = None
    ) -> Preempted:
        """The error for a run stopped before it trained any step (nothing was written).

        Args:
          start_step: the step the run would have started from.
          by: the process that received the signal, if another one ("process 1 (host:pid)").
          signal_name: the signal's name, if `by` received it (default: this process's).

        Returns:
          A `Preempted` whose message names the signal and what a rerun does.
        """
        then = "start afresh" if start_step == 0 else f"resume from step {start_step}"
        what = signal_name or self.signal_name
        if by is not None:
            what = f"{what} to {by}"
        return Preempted(
            f"Stopped by {what} during start-up, before training any step; no "
            f"checkpoint was written. Rerun the same command to {then}."
        )

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
            logger.warning(
                "Received %s: stopping after the current step and saving a checkpoint, or "
                "before the first step if still starting up (send it again to exit immediately).",
                sig.name,
            )
            return
        logger.warning("Received %s again: exiting immediately.", sig.name)
        self._restore()
        _raise_default(sig)

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            names = "/".join(s.name for s in self.signals)
            logger.warning("Not in the main thread: %s will not stop training cleanly.", names)
            return self
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        self._take_latched()
        return self

    def _take_latched(self) -> None:
        """Takes over a signal `trainers.cluster.signal_latch` recorded before this context began.

        One of `signals` stops the run before its first step; any other gets the action it
        would have had without the latch (SIGINT raises KeyboardInterrupt, SIGTERM kills).
        """
        from trainers.cluster import signal_latch

        sig = signal_latch.take()
        if sig is None:
            return
        if sig in self.signals:
            self._handle(sig, None)
            return
        _raise_default(sig)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._restore()


class FollowedStop(StopOnSignal):
    """The stop of a run in a thread that another `StopOnSignal` watches for it (a trial of a
    ``hydra/launcher=population``: the launcher's, read by its population once a round).

    Args:
      source: the name of the signal received ("SIGTERM"), or None.
    """

    def __init__(self, source: Callable[[], str | None]):
        super().__init__(())
        self._source = source

    def __call__(self) -> bool:
        """True once `source` names a signal."""
        return self._source() is not None

    @property
    def signal_name(self) -> str | None:
        """`source`'s signal name, or None."""
        return self._source()

    def __enter__(self) -> Self:
        return self  # no handler of its own: the watching thread has them
