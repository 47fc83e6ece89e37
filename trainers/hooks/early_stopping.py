"""Early stopping: a hook that ends the run when its metric stops improving.

Configured by ``trainer.early_stopping`` (`trainers.config.early_stopping`). An ``eval/``
metric is checked at every evaluation (`Hook.on_eval`), a ``train/`` metric at every step
(`Hook.on_step`). A non-finite value never improves. After ``patience`` checks in a row
without an improvement larger than ``min_delta``, `wants_stop` asks the run to end cleanly
after the current step: every hook's ``on_end`` sees reason "stopped", the evaluation runs
once more at that step, and the checkpoint hook saves it (`trainers.hooks.evaluation`).
"""

from __future__ import annotations

import logging
import math

from trainers.config.early_stopping import EarlyStoppingOptions
from trainers.core.hook import Hook
from xshard.errors import ConfigError

logger = logging.getLogger(__name__)


class EarlyStopping(Hook):
    """Watches one metric; `wants_stop` once it has not improved for `patience` checks.

    Args:
      options: the ``trainer.early_stopping`` node (its metric is set).
    """

    def __init__(self, options: EarlyStoppingOptions):
        if options.metric is None:
            raise ValueError("EarlyStopping needs trainer.early_stopping.metric.")
        self.metric: str = options.metric
        self.options = options
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_checks = 0  # checks since the last improvement
        #: The step whose check ended the run, once it has.
        self.stopped_at: int | None = None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.options.on_eval:
            return
        if self.metric not in metrics:
            shown = sorted(k for k in metrics if k.startswith("train/"))
            raise ConfigError(
                f"trainer.early_stopping.metric={self.metric!r}: the training steps have no "
                f"such metric; they have {shown}."
            )
        self._check(step, metrics[self.metric])

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self.options.on_eval and self.metric in metrics:
            self._check(step, metrics[self.metric])

    def wants_stop(self) -> bool:
        return self.stopped_at is not None

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        delta = self.options.min_delta
        if self.options.mode == "min":
            return value < self.best - delta
        return value > self.best + delta

    def _check(self, step: int, value: float) -> None:
        if self.stopped_at is not None:
            return
        if self._improved(value):
            self.best, self.best_step, self.bad_checks = value, step, 0
            return
        self.bad_checks += 1
        if self.bad_checks >= self.options.patience:
            self.stopped_at = step
            logger.info(
                "Early stopping at step %d: %s=%.5g has not improved on %s (step %s) by more "
                "than trainer.early_stopping.min_delta=%g for %d checks.",
                step,
                self.metric,
                value,
                "-" if self.best is None else f"{self.best:.5g}",
                self.best_step,
                self.options.min_delta,
                self.bad_checks,
            )


def early_stopping_hook(
    options: EarlyStoppingOptions, eval_metrics: tuple[str, ...]
) -> EarlyStopping | None:
    """The ``trainer.early_stopping`` hook, or None when it is off.

    Args:
      options: the ``trainer.early_stopping`` node.
      eval_metrics: the names of the run's evaluation metrics (none: it does not evaluate).

    Raises:
      ConfigError: an ``eval/`` metric that the run's evaluation does not have.
    """
    if not options.enabled:
        return None
    if options.on_eval and options.metric not in eval_metrics:
        has = f"the evaluation has {list(eval_metrics)}"
        why = has if eval_metrics else "the run does not evaluate"
        raise ConfigError(
            f"trainer.early_stopping.metric={options.metric!r}: {why} (a task with an eval "
            "split and trainer.eval_batches > 0 evaluates; set trainer.eval_every too)."
        )
    return EarlyStopping(options)
