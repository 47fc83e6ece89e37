"""Failed trials do not end a study: the default ``max_failure_rate`` of optimizing sweepers.

Hydra's Optuna sweeper ends the whole study as soon as the failed share of a batch of trials
exceeds its ``hydra.sweeper.max_failure_rate``, 0.0 by default: a learning-rate search ends at
the first trial that diverges. A diverged trial is an answer (that rate is too high), not a
reason to stop searching, so xshard's default is `DEFAULT_MAX_FAILURE_RATE` (every trial may
fail: the study runs all of its ``n_trials``, and the failed ones are Optuna ``FAIL`` trials,
which its samplers leave out).

`TolerateFailedTrials`, a Hydra callback registered in ``xshard_train.yaml``
(``hydra.callbacks.failed_trials``), sets that default before Hydra builds the sweeper. A value
you choose wins: ``hydra.sweeper.max_failure_rate=0.2`` on the command line or any value other
than the sweeper's own default (0.0) in a config file. To end at the first failure again, set
``hydra.callbacks.failed_trials.max_failure_rate=0``. Sweepers without the key (Hydra's basic
sweeper goes on after a failed job anyway, `trainers.app.sweep`) are left alone.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, read_write

from trainers.config.cli_args import override_key
from xshard.errors import ConfigError

log = logging.getLogger("trainers.train")

#: The sweeper key this callback sets.
KEY = "max_failure_rate"
#: xshard's default: no share of failed trials ends a study.
DEFAULT_MAX_FAILURE_RATE = 1.0
#: The value Hydra's Optuna sweeper has when nobody set it.
SWEEPER_DEFAULT = 0.0


class TolerateFailedTrials(Callback):
    """Sets ``hydra.sweeper.max_failure_rate`` to `max_failure_rate` unless it was chosen.

    Args:
      max_failure_rate: the share of failed trials per batch a study tolerates, in [0, 1].

    Raises:
      ConfigError: for a value outside [0, 1].
    """

    def __init__(self, max_failure_rate: float = DEFAULT_MAX_FAILURE_RATE) -> None:
        if (
            isinstance(max_failure_rate, bool)
            or not isinstance(max_failure_rate, int | float)
            or not (math.isfinite(max_failure_rate) and 0 <= max_failure_rate <= 1)
        ):
            raise ConfigError(
                f"hydra.callbacks.failed_trials.max_failure_rate={max_failure_rate!r}: expected "
                "a number in [0, 1] (1: no share of failed trials ends a study)."
            )
        self.max_failure_rate = float(max_failure_rate)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweeper = config.hydra.sweeper
        if KEY not in sweeper or _chosen(config):
            return
        with read_write(sweeper):
            sweeper[KEY] = self.max_failure_rate
        log.debug("hydra.sweeper.%s=%s (xshard's default)", KEY, self.max_failure_rate)


def _chosen(config: DictConfig) -> bool:
    """Whether the user chose the sweeper's rate: on the command line, or another value than
    the sweeper's own default in a config file."""
    typed = (override_key(o) for o in config.hydra.overrides.hydra)
    return f"hydra.sweeper.{KEY}" in typed or config.hydra.sweeper[KEY] != SWEEPER_DEFAULT
