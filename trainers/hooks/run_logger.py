"""The one interface of the W&B, MLflow and CSV loggers, and the hook that feeds them.

A `RunLogger` gets, in order: `start` (the run's resolved config and hyperparameters), then
`log_scalars` for every logging step and evaluation (the same scalars TensorBoard gets:
`trainers.hooks.logged_scalars`, and the ``eval/*`` metrics), then `finish` with the run's
summary (`summary_scalars`: the HParams metrics TensorBoard writes) and whether it succeeded.
`LoggerHook` adapts one to `trainers.core.Hook`; only the lead process logs
(`trainers.app.loggers` builds them). TensorBoard has its own hook
(`trainers.hooks.tensorboard`), which writes the same scalars, config and hparams.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol

from trainers.core.hook import Hook
from trainers.core.step import TrainState
from trainers.errors import LinkOutOfRunDirError, LoggerError
from trainers.hooks import hparams as hp
from trainers.hooks.logged_scalars import LoggedScalars
from trainers.hooks.summary import RunSummary
from trainers.rundir.outputs import Outputs

logger = logging.getLogger(__name__)

#: The errors of a disk that is full or failing: a logger that meets one at start-up follows
#: ``logger.on_error`` as it would during the run; any other error there means it cannot start.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a logger learns when the run starts.

    Attributes:
      name: the run's name (its TensorBoard folder's: the overrides).
      config: the resolved config, as plain containers.
      config_yaml: the same, as YAML text.
      hparams: the hyperparameters TensorBoard's HParams shows (`trainers.hooks.hparams`).
    """

    name: str
    config: dict[str, Any]
    config_yaml: str
    hparams: dict[str, Any]


class RunLogger(Protocol):
    """A place a run's scalars go (W&B, MLflow, a CSV file)."""

    #: The logger's option name (``logger=<name>``), for error messages.
    name: str
    #: Where it writes, as the config key and its value (``logger.csv.path='...'``).
    destination: str

    def outputs(self) -> Outputs:
        """The files and folders it writes (checked for links at start-up)."""

    def start(self, run: RunInfo) -> None:
        """Opens the run and records its config and hyperparameters."""

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records `scalars` at `step` (an `OSError`: it failed to write; nothing more is)."""

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        """Records the run's summary and closes it (once; never raises for a lost run, an
        `OSError` if the summary cannot be written)."""


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


class LoggerHook(Hook):
    """Hands a run's scalars to a `RunLogger`.

    A write that fails (an `OSError`: a full disk; at start-up, one of `DISK_ERRNOS`) is
    handled as TensorBoard's hook handles one (`trainers.hooks.tensorboard`): with
    ``logger.on_error=stop`` the run stops cleanly after the current step, saves its
    checkpoint and `on_end` raises `LoggerError`; with ``continue`` one warning, and the run
    trains on without this logger.

    Args:
      logger: the logger, not started yet (`start` is called here).
      run: what it records first.
      scalars: the run's `LoggedScalars` (its own instance: it keeps moving averages).
      summary: the run's summary, read at the end.
      on_error: "stop" or "continue" (``logger.on_error``).

    Raises:
      LoggerError: the logger could not start (a bad tracking URI, no access; its files
        cannot be written and `on_error` is "stop"): one line naming ``logger=<name>``, before
        training. From `on_end`: a write failed and `on_error` is "stop".
      LinkOutOfRunDirError: a file it appends to is a link (`trainers.rundir.outputs`).
    """

    def __init__(
        self,
        logger: RunLogger,
        run: RunInfo,
        scalars: LoggedScalars,
        summary: RunSummary,
        *,
        on_error: str = "stop",
    ):
        self.logger, self.scalars, self.summary = logger, scalars, summary
        self.on_error = on_error
        self.failure: str | None = None
        self.last_step: int | None = None
        self._full = False
        try:
            logger.start(run)
        except LinkOutOfRunDirError:
            raise
        except OSError as e:
            if e.errno not in DISK_ERRNOS:  # no access, a network error: cannot start
                raise LoggerError(
                    f"logger={logger.name} could not start the run: {type(e).__name__}: {e}"
                ) from e
            self._failed(e)
            if on_error == "stop":
                raise LoggerError(self._error_message("before training")) from e
        except Exception as e:  # noqa: BLE001 - whatever the package raises, one line
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LoggerError(
                f"logger={logger.name} could not start the run: {type(e).__name__}: {text}"
            ) from e

    def _failed(self, error: OSError) -> None:
        """Records the first failed write and reports it once: the run stops, or goes on."""
        if self.failure is not None:
            return
        self.failure = error.strerror or f"{type(error).__name__}: {error}"
        self._full = error.errno in DISK_ERRNOS
        if self.on_error == "continue":
            logger.warning(
                "logger=%s cannot write to %s (%s): training continues without it "
                "(logger.on_error=continue).",
                self.logger.name,
                self.logger.destination,
                self.failure,
            )
        else:
            logger.error(
                "logger=%s cannot write to %s (%s): stopping after this step "
                "(logger.on_error=stop).",
                self.logger.name,
                self.logger.destination,
                self.failure,
            )

    def _error_message(self, when: str) -> str:
        fix = "Free space there" if self._full else "Fix that"
        return (
            f"logger={self.logger.name} cannot write to {self.logger.destination}: "
            f"{self.failure}. The run stopped cleanly {when} (logger.on_error=stop). {fix} "
            "and rerun the same command to resume, or set logger.on_error=continue to train "
            "without it."
        )

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        if self.failure is not None or not scalars:
            return
        try:
            self.logger.log_scalars(step, scalars)
        except OSError as e:
            self._failed(e)

    def wants_stop(self) -> bool:
        return self.on_error == "stop" and self.failure is not None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        logged = [*self.scalars.on_its_step(metrics), *(self.scalars(step, metrics) or [])]
        self._log(step, dict(logged))

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._log(step, dict(metrics))

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        step = self.last_step if self.last_step is not None else step
        final = self.summary.final_loss
        success = reason != "error" and final is not None and math.isfinite(final)
        try:  # after a failure too: the logger closes what it holds
            self.logger.finish(summary_scalars(self.summary, step), success)
        except OSError as e:
            self._failed(e)
        if self.failure is not None and self.on_error == "stop" and reason != "error":
            raise LoggerError(self._error_message(f"at step {step}"))
