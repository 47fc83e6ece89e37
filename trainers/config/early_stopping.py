"""The ``trainer.early_stopping`` node: stop a run whose metric stopped improving.

A run stops early when its metric has not improved by more than ``min_delta`` for
``patience`` checks in a row. An ``eval/<metric>`` is checked at every evaluation
(``trainer.eval_every``), a ``train/<metric>`` at every step. The run then ends cleanly: a
final evaluation and a checkpoint at the step it stopped (`trainers.hooks.early_stopping`).
"""

from __future__ import annotations

import dataclasses
import math

from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: How the metric improves.
MODES = ("min", "max")
#: The metrics early stopping can watch: those of the evaluation, or of the training steps.
METRIC_PREFIXES = ("eval/", "train/")
KEY = "trainer.early_stopping"


@dataclasses.dataclass  # not frozen: a nested node (xshard.config.nodes.permissive)
class EarlyStoppingOptions:
    """The ``trainer.early_stopping`` node.

    Attributes:
      metric: ``eval/<metric>`` (e.g. ``eval/loss``) or ``train/<metric>``; null: no early
        stopping.
      mode: "min" (lower is better) or "max".
      patience: checks without an improvement after which the run stops (evaluations for an
        ``eval/`` metric, steps for a ``train/`` one).
      min_delta: how much the metric must beat its best so far to count as an improvement.
    """

    metric: str | None = None
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        metric = self.metric
        if metric is not None and (
            not isinstance(metric, str)
            or not metric.startswith(METRIC_PREFIXES)
            or metric in METRIC_PREFIXES
        ):
            raise ConfigError(
                f"{KEY}.metric={shown(metric)}: expected 'eval/<metric>' (e.g. 'eval/loss') or "
                "'train/<metric>' (e.g. 'train/loss'), or null (no early stopping)."
            )
        if self.mode not in MODES:
            raise ConfigError(f"{KEY}.mode={shown(self.mode)}: expected one of {list(MODES)}.")
        patience = self.patience
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(
                f"{KEY}.patience={shown(patience)}: expected an integer >= 1, the checks "
                "without an improvement after which the run stops."
            )
        delta = self.min_delta
        if (
            isinstance(delta, bool)
            or not isinstance(delta, int | float)
            or not math.isfinite(delta)
            or delta < 0
        ):
            raise ConfigError(
                f"{KEY}.min_delta={shown(delta)}: expected a finite number >= 0, the least "
                "change that counts as an improvement."
            )

    @property
    def enabled(self) -> bool:
        """Whether the run stops early (a metric is set)."""
        return self.metric is not None

    @property
    def on_eval(self) -> bool:
        """Whether the metric is one of the evaluation's."""
        return self.metric is not None and self.metric.startswith("eval/")
