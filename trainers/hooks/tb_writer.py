"""A tensorboardX `SummaryWriter` that can neither hang nor crash the run when writing fails.

tensorboardX writes events from a background thread: ``add_*`` calls put events on a bounded
queue, and the thread writes them and flushes every ``flush_secs``. When that thread dies
(disk full), it prints a traceback on stderr, the queue fills up, and the next ``add_*``
blocks forever, signals included. `SafeSummaryWriter`:

- gives the writer a queue too large to fill (`QUEUE_SIZE`, a public ``SummaryWriter``
  argument), so that putting an event never blocks;
- before each write, checks that the writer's threads (those the ``SummaryWriter``
  constructor started) are alive; a `threading.excepthook` records why one died and keeps
  its traceback off stderr;
- catches the `OSError`s of the flushes done in the calling thread (`flush`, `close`), and
  keeps tensorboardX's exit handler from flushing a failed writer again (`_abandon`).

After a failure every write is dropped and `failure` says why, in one line. What to do about
it (stop the run, or go on without events) is the caller's choice: `TensorBoardHook`,
``logger.on_error``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX import summary as tbx_summary
from tensorboardX.proto.summary_pb2 import Summary

#: Events the writer's queue can hold. A dead thread is noticed before the next write, so at
#: most one write's events are left behind in its queue; a live one keeps draining it.
QUEUE_SIZE = 1 << 20

# Writer threads -> their SafeSummaryWriter, for `_excepthook`.
_WATCHED: dict[threading.Thread, SafeSummaryWriter] = {}
_WATCHED_LOCK = threading.Lock()
_previous_excepthook: Callable[[Any], Any] | None = None


def _excepthook(args: Any) -> None:
    """Records the death of a watched writer thread (no traceback); others as before.

    Waits for `_WATCHED_LOCK`: a thread that dies while its writer is being built is looked
    up once it is registered.
    """
    with _WATCHED_LOCK:
        writer = _WATCHED.get(args.thread)
    if writer is not None and args.exc_value is not None:
        writer._record(args.exc_value)
        return
    (_previous_excepthook or threading.__excepthook__)(args)


def _install_excepthook() -> None:
    """Puts `_excepthook` in front of the current `threading.excepthook` (call with the lock)."""
    global _previous_excepthook
    if threading.excepthook is not _excepthook:
        _previous_excepthook = threading.excepthook
        threading.excepthook = _excepthook


def _unwatch(threads: list[threading.Thread]) -> None:
    with _WATCHED_LOCK:
        for t in threads:
            _WATCHED.pop(t, None)


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


class SafeSummaryWriter:
    """The part of `tensorboardX.SummaryWriter` the trainer uses, minus hangs and crashes.

    Args:
      logdir: the TensorBoard directory.
      flush_secs: how often the writer thread flushes to disk (seconds, > 0).

    Attributes:
      failure: why writing failed (e.g. "No space left on device"), or None.
    """

    def __init__(self, logdir: str, *, flush_secs: float):
        self.logdir = logdir
        self.failure: str | None = None
        self._closed = False
        self._writer: SummaryWriter | None = None
        self._threads: list[threading.Thread] = []
        with _WATCHED_LOCK:  # the writer's threads are registered before their hook can look
            _install_excepthook()
            before = set(threading.enumerate())
            try:
                self._writer = SummaryWriter(
                    logdir=logdir, flush_secs=flush_secs, max_queue=QUEUE_SIZE
                )
            except OSError as e:
                self._record(e)
            for t in threading.enumerate():
                if t not in before and type(t).__module__.startswith("tensorboardX"):
                    self._threads.append(t)
                    _WATCHED[t] = self

    def _record(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = _describe(error)

    def ok(self) -> bool:
        """True while writing works; False for good once it failed (never blocks)."""
        if self.failure is None and not self._closed:
            dead = [t for t in self._threads if not t.is_alive()]
            if dead:  # its excepthook ran before it ended, so `failure` is set if it raised
                self._record(RuntimeError(f"the TensorBoard writer thread {dead[0].name} ended"))
        return self.failure is None and self._writer is not None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self._closed or not self.ok():
            return
        try:
            getattr(self._writer, method)(*args, **kwargs)
        except OSError as e:
            self._record(e)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """Writes one scalar (dropped after a failure)."""
        self._call("add_scalar", tag, value, step)

    def add_scalars(self, values: Iterable[tuple[str, float]], step: int) -> None:
        """Writes several scalars of one step as one event (dropped after a failure).

        TensorBoard reads them as `add_scalar` writes them, one point per tag at `step`; one
        event instead of one per tag spares the writer's queue and threads ~20 events per
        logging step (docs/benchmarks.md, "Host overhead of `Trainer.fit`").

        Args:
          values: (tag, value) pairs; tags are cleaned as `add_scalar` cleans them.
          step: their global step.
        """
        summary = Summary(
            value=[
                # tensorboardX's own tag cleaning (private; `add_scalar` applies it too).
                Summary.Value(tag=tbx_summary._clean_tag(tag), simple_value=float(value))
                for tag, value in values
            ]
        )
        if summary.value:
            self.add_summary(summary, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Writes one text summary (dropped after a failure)."""
        self._call("add_text", tag, text, step)

    def add_histogram_raw(self, tag: str, **kwargs: Any) -> None:
        """`SummaryWriter.add_histogram_raw` (dropped after a failure)."""
        self._call("add_histogram_raw", tag, **kwargs)

    def add_custom_scalars(self, layout: dict[str, dict[str, list]]) -> None:
        """`SummaryWriter.add_custom_scalars`: the Custom Scalars dashboard's layout."""
        self._call("add_custom_scalars", layout)

    def add_summary(self, summary: Any, step: int | None = None) -> None:
        """Writes a prebuilt `Summary` proto, e.g. an hparams summary (dropped after a failure)."""
        if not self._closed and self.ok():
            assert self._writer is not None  # ok() holds
            try:
                self._writer.file_writer.add_summary(summary, step)
            except OSError as e:
                self._record(e)

    def flush(self) -> None:
        """Writes pending events to disk (in the calling thread)."""
        self._call("flush")

    def close(self) -> None:
        """Flushes and closes the writer (idempotent). After a failure, closes what it can."""
        if self._closed:
            return
        if self.ok():
            assert self._writer is not None  # ok() holds
            try:
                self._writer.close()
            except OSError as e:
                self._record(e)
        self._closed = True
        if self.failure is None:
            _unwatch(self._threads)  # a failed writer's threads may still end with an error
        else:
            self._abandon()

    def _abandon(self) -> None:
        """Marks a failed writer closed, so that tensorboardX's own exit handler (`atexit`)
        does not flush it again and print the same error's traceback.

        The one private attribute used (`EventFileWriter._closed`, which makes its ``add_event``,
        ``flush`` and ``close`` no-ops); without it, a traceback at exit is the worst case.
        """
        event_writer = getattr(getattr(self._writer, "file_writer", None), "event_writer", None)
        if event_writer is not None and hasattr(event_writer, "_closed"):
            event_writer._closed = True
