"""``logger=tensorboard``: the run's event file: scalars, diagnostics, the config and HParams.

One event file per run, at ``paths.tb_dir`` (a folder named by the run's overrides), written
with tensorboardX's `EventsWriter` in the calling thread: a failed write (a full disk) is a
plain `OSError` where it happens, and `trainers.hooks.run_logger.LoggerHook` follows
``logger.on_error``. Writes go to the file's buffer; it is flushed (and synced) at start-up, at
the first write ``logger.flush_secs`` after the last flush, and at the end. The hparams summary
(`trainers.hooks.hparams`) goes into the same file (tensorboardX's `add_hparams` would open a
second one in a subfolder), so a multirun sweep shows one run per job in both the Scalars and
the HParams dashboards; the custom-scalars layout puts loss, learning rate, gradient norms and
throughput on one screen.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping

from trainers.hooks import hparams as hp
from trainers.hooks.log_sink import Histogram, LogSink, RunInfo
from trainers.hooks.tbx import Event, EventsWriter, Summary, directory_check
from trainers.hooks.tbx import summary as tbx_summary


class TensorBoardSink(LogSink):
    """A `trainers.hooks.log_sink.LogSink` writing a TensorBoard event file in `logdir`.

    A step's scalars are one event (TensorBoard reads them as one point per tag at the step);
    tags are cleaned as tensorboardX's `summary.scalar` cleans them. After a failed write the
    file is closed and nothing more is written.

    Args:
      logdir: the run's TensorBoard directory (``paths.tb_dir``).
      flush_secs: the longest time between two flushes while events are written (> 0).
    """

    name = "tensorboard"

    def __init__(self, logdir: str, *, flush_secs: float):
        self.logdir = logdir
        self.destination = f"paths.tb_dir={logdir!r}"
        self.flush_secs = flush_secs
        self._writer: EventsWriter | None = None
        self._flushed = 0.0  # time.monotonic() of the last flush
        self._tags: dict[str, str] = {}  # tag -> as written
        self._session = False  # an HParams session was started: it is ended at `finish`

    def start(self, run: RunInfo) -> None:
        directory_check(self.logdir)  # as `SummaryWriter` makes it (a local or remote dir)
        self._writer = EventsWriter(os.path.join(self.logdir, "events"))
        if run.config_yaml:  # indented lines render as a code block in TensorBoard's markdown
            text = "\n".join("    " + line for line in run.config_yaml.splitlines())
            self._write(tbx_summary.text("config", text), 0)
        if run.hparams:
            metrics = hp.METRICS + hp.eval_metric_tags(run.eval_metrics)
            self._write(hp.experiment_summary(run.hparams, run.overridden, metrics))
            self._write(hp.session_start_summary(run.hparams))
            self._session = True
        self._write(tbx_summary.custom_scalars(hp.custom_scalars_layout()))
        self._flush()  # a disk that is full already fails here, before training

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if not scalars:
            return
        event = Event(step=int(step))
        add = event.summary.value.add  # in place: no copy of the values into the event
        for tag, value in scalars.items():
            add(tag=self._tag(tag), simple_value=float(value))
        self._append(event)

    def log_diagnostics(
        self, step: int, norms: Mapping[str, float], histograms: Mapping[str, Histogram]
    ) -> None:
        """The per-layer norms as one event, the gradient histograms as another."""
        self.log_scalars(step, norms)
        values = [
            value
            for tag, h in histograms.items()
            for value in tbx_summary.histogram_raw(tag, *h).value
        ]
        if values:
            self._write(Summary(value=values), step)

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        """Writes the summary scalars at the last step, ends the HParams session, closes."""
        if self._writer is None:
            return
        self.log_scalars(int(summary.get(hp.LAST_STEP_TAG, 0)), summary)
        if self._session:
            self._write(hp.session_end_summary(success))
        self._guarded(self._writer.close)
        self._writer = None

    def _tag(self, tag: str) -> str:
        """`tag` as tensorboardX's `summary.scalar` writes it (cleaned once per tag)."""
        if tag not in self._tags:
            (value,) = tbx_summary.scalar(tag, 0.0).value
            self._tags[tag] = value.tag
        return self._tags[tag]

    def _write(self, summary: Summary, step: int | None = None) -> None:
        """Appends `summary` as one event (at `step`, if given)."""
        event = Event(summary=summary)
        if step is not None:
            event.step = int(step)
        self._append(event)

    def _append(self, event: Event) -> None:
        """Writes `event`, stamped now; flushes when `flush_secs` passed since the last flush."""
        if self._writer is None:
            return
        event.wall_time = time.time()
        self._guarded(self._writer.write_event, event)
        if time.monotonic() - self._flushed >= self.flush_secs:
            self._flush()

    def _flush(self) -> None:
        if self._writer is not None:
            self._guarded(self._writer.flush)
            self._flushed = time.monotonic()

    def _guarded(self, write: Callable[..., object], *args: object) -> None:
        """Runs `write`; on an `OSError` drops the writer (its file closed) and raises it."""
        try:
            write(*args)
        except OSError:
            writer, self._writer = self._writer, None
            if writer is not None:  # its buffer holds what failed: closing may fail again
                with contextlib.suppress(OSError):
                    writer.close()
            raise

    # ------------------------------------------------------------------ failures, in words

    def write_failure(self, error: OSError) -> bool:
        """Any `OSError` from the event file is a failed write (``logger.on_error``)."""
        return True

    def failure_line(self, reason: str, *, stopping: bool) -> str:
        then = (
            "stopping after this step (logger.on_error=stop)"
            if stopping
            else "training continues without them (logger.on_error=continue)"
        )
        return f"TensorBoard events cannot be written to {self.logdir} ({reason}): {then}."

    def stopped_message(self, reason: str, when: str, *, full: bool) -> str:
        return (
            f"TensorBoard events cannot be written to {self.destination}: {reason}. The run "
            f"stopped cleanly {when} (logger.on_error=stop). Free space there and rerun the "
            "same command to resume, or set logger.on_error=continue to train without events."
        )
