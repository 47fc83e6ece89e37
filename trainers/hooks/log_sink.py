"""What every logger implements: `LogSink`, the place a run's logs go, and what it is given.

`trainers.hooks.run_logger.LoggerHook` computes a step's scalars once and hands them to each
sink; a sink only writes (TensorBoard: `trainers.hooks.tensorboard`; W&B, MLflow, CSV:
`wandb_logger`, `mlflow_logger`, `csv_logger`). A write that fails raises `OSError`, and the
hook decides what the run does (``logger.on_error``), in the words the sink gives it.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
from collections.abc import Mapping
from typing import Any, NamedTuple

from trainers.rundir.outputs import Outputs

#: The errors of a disk that is full or failing: a logger that meets one at start-up follows
#: ``logger.on_error`` as it would during the run; any other error there means it cannot start.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a logger learns when the run starts.

    Attributes:
      name: the run's name (its TensorBoard folder's: the overrides).
      config: the resolved config, as plain containers.
      config_yaml: the same, as YAML text ("": none to record).
      hparams: the hyperparameters TensorBoard's HParams shows (`trainers.hooks.hparams`;
        empty: no HParams entry).
      overridden: the hparams the command line overrode (TensorBoard lists them first).
      eval_metrics: the evaluation's metric names (``eval/loss``, ...): HParams metrics too.
    """

    name: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    config_yaml: str = ""
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)
    overridden: frozenset[str] = frozenset()
    eval_metrics: tuple[str, ...] = ()


class Histogram(NamedTuple):
    """A histogram as TensorBoard takes it (``add_histogram_raw``): the values' count, range,
    sum and sum of squares, each bucket's upper limit and count."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]


class LogSink(abc.ABC):
    """A place a run's logs go (TensorBoard, W&B, MLflow, a CSV file).

    Attributes:
      name: the logger's option name (``logger=<name>``), for messages.
      destination: where it writes, as the config key and its value
        (``logger.csv.path='...'``), for messages.
    """

    name: str
    destination: str

    def outputs(self) -> Outputs:
        """The files and folders it writes in the run dir (checked for links at start-up)."""
        return Outputs()

    @abc.abstractmethod
    def start(self, run: RunInfo) -> None:
        """Opens the run and records its config and hyperparameters."""

    @abc.abstractmethod
    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Records `scalars` at `step` (an `OSError`: it failed to write; nothing more is)."""

    def log_diagnostics(
        self, step: int, norms: Mapping[str, float], histograms: Mapping[str, Histogram]
    ) -> None:
        """Records a step's per-layer norms and gradient histograms; by default they are
        dropped (TensorBoard shows them)."""
        del step, norms, histograms

    @abc.abstractmethod
    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        """Records the run's summary and closes it (once; never raises for a lost run, an
        `OSError` if the summary cannot be written)."""

    # ------------------------------------------------------------------ failures, in words

    def write_failure(self, error: OSError) -> bool:
        """Whether an `OSError` from `start` is a failed write (``logger.on_error`` decides)
        rather than a run that cannot start: by default one of `DISK_ERRNOS`."""
        return error.errno in DISK_ERRNOS

    def failure_line(self, reason: str, *, stopping: bool) -> str:
        """The log line for a failed write: the run stops after this step, or goes on."""
        then = (
            "stopping after this step (logger.on_error=stop)"
            if stopping
            else "training continues without it (logger.on_error=continue)"
        )
        return f"logger={self.name} cannot write to {self.destination} ({reason}): {then}."

    def stopped_message(self, reason: str, when: str, *, full: bool) -> str:
        """The `LoggerError` of a run stopped by a failed write (`when`: "at step 7")."""
        fix = "Free space there" if full else "Fix that"
        return (
            f"logger={self.name} cannot write to {self.destination}: {reason}. The run stopped "
            f"cleanly {when} (logger.on_error=stop). {fix} and rerun the same command to "
            "resume, or set logger.on_error=continue to train without it."
        )
