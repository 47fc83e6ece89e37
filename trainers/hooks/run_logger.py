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
import math
from collections.abc import Mapping
from typing import Any, Protocol

from trainers.core.hook import Hook
from trainers.core.step import TrainState
from trainers.errors import LoggerError
from trainers.hooks import hparams as hp
from trainers.hooks.logged_scalars import LoggedScalars
from trainers.hooks.summary import RunSummary


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

    def start(self, run: RunInfo) -> None:
        """Opens the run and records its config and hyperparameters."""

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records `scalars` at `step`."""

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        """Records the run's summary and closes it (once; never raises for a lost run)."""


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

    Args:
      logger: the logger, not started yet (`start` is called here).
      run: what it records first.
      scalars: the run's `LoggedScalars` (its own instance: it keeps moving averages).
      summary: the run's summary, read at the end.

    Raises:
      LoggerError: the logger could not start (a bad tracking URI, no access): one line
        naming ``logger=<name>``, before training.
    """

    def __init__(
        self, logger: RunLogger, run: RunInfo, scalars: LoggedScalars, summary: RunSummary
    ):
        self.logger, self.scalars, self.summary = logger, scalars, summary
        self.last_step: int | None = None
        try:
            logger.start(run)
        except Exception as e:  # noqa: BLE001 - whatever the package raises, one line
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise LoggerError(
                f"logger={logger.name} could not start the run: {type(e).__name__}: {text}"
            ) from e

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        logged = [*self.scalars.on_its_step(metrics), *(self.scalars(step, metrics) or [])]
        if logged:
            self.logger.log_scalars(step, dict(logged))

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log_scalars(step, dict(metrics))

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        step = self.last_step if self.last_step is not None else step
        final = self.summary.final_loss
        success = reason != "error" and final is not None and math.isfinite(final)
        self.logger.finish(summary_scalars(self.summary, step), success)
