"""The run's one logging pipeline: `LoggerHook` computes what a step logs, `LogSink`s write it.

Every logger (``logger=[tensorboard,wandb,mlflow,csv]``) is a `LogSink`: TensorBoard
(`trainers.hooks.tensorboard`), W&B, MLflow and CSV (`wandb_logger`, `mlflow_logger`,
`csv_logger`). A sink gets, in order: `LogSink.start` (the run's resolved config and
hyperparameters), then `LogSink.log_scalars` for every logging step and evaluation (the scalars
of `trainers.hooks.logged_scalars`, computed once for all sinks, and the ``eval/*`` metrics),
`LogSink.log_diagnostics` for the per-layer statistics (TensorBoard's norms and histograms;
the others ignore them), then `LogSink.finish` with the run's summary (`summary_scalars`: the
HParams metrics) and whether it succeeded. Only the lead process logs (`trainers.app.loggers`
builds the hook).

A write that fails (an `OSError`: a full disk) follows ``logger.on_error``, sink by sink: with
``stop`` the run stops cleanly after the current step, saves its checkpoint and `on_end`
raises `LoggerError`; with ``continue`` one warning, and the run trains on without that sink.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from trainers.config.outputs import ON_ERROR
from trainers.core.hook import Hook
from trainers.core.step import TrainState
from trainers.exits import LinkOutOfRunDirError, LoggerError
from trainers.hooks import hparams as hp
from trainers.hooks.log_sink import DISK_ERRNOS, Histogram, LogSink, RunInfo
from trainers.hooks.logged_scalars import LoggedScalars
from trainers.hooks.summary import RunSummary

logger = logging.getLogger(__name__)


def summary_scalars(summary: RunSummary, step: int) -> dict[str, float]:
    """The run's summary as the HParams metrics TensorBoard writes at the end: final and best
    loss, last step, and the final and best evaluation's metrics."""
    out: dict[str, float] = {hp.LAST_STEP_TAG: float(step)}
    if summary.final_loss is not None:
        out[hp.FINAL_LOSS_TAG] = summary.final_loss
    if summary.best_loss is not None:
        out[hp.BEST_LOSS_TAG] = summary.best_loss
    final_eval, best_eval = summary.eval_results()
    for kind, metrics in (("final", final_eval), ("best", best_eval)):
        for name, value in (metrics or {}).items():
            out[hp.eval_metric_tag(kind, name)] = value
    return out


class Diagnostics(NamedTuple):
    """A step's per-layer statistics as logged: norms (``layers/grad_norm/<layer>``,
    ``layers/param_norm/<layer>``) and gradient histograms (``grad_hist/<layer>``)."""

    norms: dict[str, float]
    histograms: dict[str, Histogram]


def diagnostics_of(diag: Mapping[str, Any]) -> Diagnostics:
    """The tags and values of `Trainer.fit`'s per-layer diagnostics (`Hook.on_diagnostics`);
    an empty histogram is left out."""
    norms = {
        f"layers/{kind}/{name}": float(value)
        for kind, key in (("grad_norm", "grad_norms"), ("param_norm", "param_norms"))
        for name, value in diag.get(key, {}).items()
    }
    histograms = {
        f"grad_hist/{name}": Histogram(
            min=float(h["min"]),
            max=float(h["max"]),
            num=float(h["num"]),
            sum=float(h["sum"]),
            sum_squares=float(h["sum_squares"]),
            bucket_limits=[float(x) for x in h["bucket_limits"]],
            bucket_counts=[float(x) for x in h["bucket_counts"]],
        )
        for name, h in diag.get("grad_hist", {}).items()
        if float(h["num"]) > 0
    }
    return Diagnostics(norms, histograms)


@dataclasses.dataclass(frozen=True)
class _Failure:
    """Why a sink stopped writing: its one-line reason, and whether the disk is to blame."""

    reason: str
    full: bool


class LoggerHook(Hook):
    """Computes what each step logs, once, and hands it to every sink (module docstring).

    Args:
      sinks: the run's loggers, not started yet (`LogSink.start` is called here, in order).
      run: what they record first.
      scalars: the run's `LoggedScalars` (it keeps the moving averages and the throughput).
      summary: the run's summary, read at the end.
      on_error: "stop" or "continue" (``logger.on_error``).

    Raises:
      ValueError: for an `on_error` other than "stop" or "continue".
      LoggerError: a sink could not start (a bad tracking URI, no access; its files cannot be
        written and `on_error` is "stop"): one line naming it, before training. From `on_end`:
        a write failed and `on_error` is "stop".
      LinkOutOfRunDirError: a file a sink appends to is a link (`trainers.rundir.outputs`).
    """

    def __init__(
        self,
        sinks: Sequence[LogSink],
        run: RunInfo,
        scalars: LoggedScalars,
        summary: RunSummary,
        *,
        on_error: str = "stop",
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {list(ON_ERROR)}.")
        self.sinks = tuple(sinks)
        self.scalars, self.summary, self.on_error = scalars, summary, on_error
        self.failures: dict[int, _Failure] = {}  # by id(sink): a sink need not be hashable
        self.last_step: int | None = None
        for sink in self.sinks:
            self._start(sink, run)

    def _start(self, sink: LogSink, run: RunInfo) -> None:
        try:
            sink.start(run)
        except LinkOutOfRunDirError:
            raise
        except OSError as e:
            if not sink.write_failure(e):  # no access, a network error: cannot start
                raise LoggerError(
                    f"logger={sink.name} could not start the run: {type(e).__name__}: {e}"
                ) from e
            self._failed(sink, e)
            if self.on_error == "stop":
                raise LoggerError(self._stopped(sink, "before training")) from e
        except Exception as e:  # whatever the package raises, one line
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LoggerError(
                f"logger={sink.name} could not start the run: {type(e).__name__}: {text}"
            ) from e

    def _failed(self, sink: LogSink, error: OSError) -> None:
        """Records a sink's first failed write and reports it once: the run stops, or goes on."""
        if id(sink) in self.failures:
            return
        reason = error.strerror or f"{type(error).__name__}: {error}"
        self.failures[id(sink)] = _Failure(reason, error.errno in DISK_ERRNOS)
        if self.on_error == "continue":
            logger.warning(sink.failure_line(reason, stopping=False))
        else:
            logger.error(sink.failure_line(reason, stopping=True))

    def _stopped(self, sink: LogSink, when: str) -> str:
        failure = self.failures[id(sink)]
        return sink.stopped_message(failure.reason, when, full=failure.full)

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        if not scalars:
            return
        for sink in self.sinks:
            if id(sink) not in self.failures:
                try:
                    sink.log_scalars(step, scalars)
                except OSError as e:
                    self._failed(sink, e)

    def wants_stop(self) -> bool:
        return self.on_error == "stop" and bool(self.failures)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        logged = [*self.scalars.on_its_step(metrics), *(self.scalars(step, metrics) or [])]
        self._write(step, dict(logged))

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Writes an evaluation's metrics (``eval/<name>``) at `step` (an `EvalHook` sink)."""
        self._write(step, dict(metrics))

    def on_diagnostics(self, step: int, diag: dict[str, Any]) -> None:
        diagnostics = diagnostics_of(diag)
        for sink in self.sinks:
            if id(sink) not in self.failures:
                try:
                    sink.log_diagnostics(step, diagnostics.norms, diagnostics.histograms)
                except OSError as e:
                    self._failed(sink, e)

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        step = self.last_step if self.last_step is not None else step
        final = self.summary.final_loss
        success = reason != "error" and final is not None and math.isfinite(final)
        scalars = summary_scalars(self.summary, step)
        for sink in self.sinks:
            try:  # after a failure too: the sink closes what it holds
                sink.finish(scalars, success)
            except OSError as e:
                self._failed(sink, e)
        if self.on_error != "stop" or reason == "error" or not self.failures:
            return
        failed = [sink for sink in self.sinks if id(sink) in self.failures]
        first, *others = (self._stopped(sink, f"at step {step}") for sink in failed)
        for message in others:
            logger.error("%s", message)
        raise LoggerError(first)
