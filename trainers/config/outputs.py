"""The run's output nodes: ``paths``, ``checkpoint`` and ``logger`` (`trainers.config.loggers`).

Defaults live here; the YAML options state only what differs (``checkpoint=none``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainers.config.loggers import (
    CsvLogger,
    MlflowLogger,
    TensorBoardLogger,
    WandbLogger,
    check_installed,
)
from trainers.config.run import check_int, check_steps, finite_positive
from trainers.config.run_names import SHORT, check_style
from xshard.config.nodes import LOCATION, read_node
from xshard.errors import ConfigError

#: What a logger does when it cannot write (disk full): ``logger.on_error``.
ON_ERROR = ("stop", "continue")


@dataclasses.dataclass(frozen=True)
class PathsOptions:
    """The ``paths`` config node: every directory the run writes (interpolations resolved).

    Attributes:
      output_dir: the run's own dir (Hydra's ``hydra.run.dir``, or the job's dir in a
        multirun): log file, config dump, the checkpoint dir's owner record.
      tb_dir: TensorBoard events, in a folder named by the run's overrides so that
        TensorBoard's run names read as them (``logger.run_names``): ``<output dir>/tb/<name>``
        for a run (view with ``--logdir <output dir>/tb``), ``<sweep dir>/tb/<job subdir>``
        for a multirun job (``xshard.tb_dir`` in `trainers.config.resolvers`).
      checkpoint_dir: Orbax checkpoints, one folder per step.
    """

    output_dir: str = dataclasses.field(default="${hydra:runtime.output_dir}", metadata=LOCATION)
    tb_dir: str = dataclasses.field(
        default="${xshard.tb_dir:${paths.output_dir},${logger.run_names}}", metadata=LOCATION
    )
    checkpoint_dir: str = dataclasses.field(
        default="${paths.output_dir}/checkpoints", metadata=LOCATION
    )

    @classmethod
    def from_config(cls, node: Any) -> PathsOptions:
        """Reads the ``paths`` node (`read_node`: one-line errors naming the key)."""
        return read_node(cls, node, "paths")

    def __post_init__(self) -> None:
        for key in ("output_dir", "tb_dir", "checkpoint_dir"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"paths.{key}={value!r}: expected a directory path.")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """The ``checkpoint`` config node.

    Attributes:
      enabled: write checkpoints (restoring does not depend on it).
      every_steps: save every N steps (0: only at the end of the run).
      keep: keep the last K checkpoints (null: all).
      keep_period: also keep every M-th step forever (null: none).
      async_save: write in a background thread; the step loop does not wait.
      fallback_to_previous: restore the previous step when the latest is corrupted.
      replica_parallel: split the device-to-host copy of replicated arrays over their
        replicas (Orbax's replica-parallel save); null: only with more than one process,
        where it spreads the writing over the hosts (on one process its first use compiles
        for seconds inside the first save).
    """

    enabled: bool = True
    every_steps: int = 100
    keep: int | None = 3
    keep_period: int | None = None
    async_save: bool = True
    fallback_to_previous: bool = False
    replica_parallel: bool | None = None

    @classmethod
    def from_config(cls, node: Any) -> CheckpointOptions:
        """Reads the ``checkpoint`` node (`read_node`: one-line errors naming the key)."""
        return read_node(cls, node, "checkpoint")

    def __post_init__(self) -> None:
        if self.replica_parallel is not None and not isinstance(self.replica_parallel, bool):
            raise ConfigError(
                f"checkpoint.replica_parallel={self.replica_parallel!r}: expected true, false "
                "or null (only with more than one process)."
            )
        for key in ("enabled", "async_save", "fallback_to_previous"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"checkpoint.{key}={getattr(self, key)!r}: expected true or false."
                )
        check_steps(self.every_steps, "checkpoint.every_steps", 0, "0 (only at the end) or more")
        if self.enabled:
            if self.keep is not None:
                check_int(self.keep, "checkpoint.keep", 1, "null (keep all) or >= 1")
            if self.keep_period is not None:
                check_steps(self.keep_period, "checkpoint.keep_period", 1, "null or >= 1")


@dataclasses.dataclass(frozen=True)
class LoggerOptions:
    """The ``logger`` config node.

    Attributes:
      flush_secs: how often the TensorBoard writer flushes to disk (seconds, > 0).
      on_error: when events or a logger's files cannot be written (disk full): "stop" the run
        cleanly (checkpoint saved, exit 2) or "continue" training without them (one warning).
      noise_ema_steps: time constant, in training steps, of ``grad/noise_scale_ema``'s moving
        averages (`trainers.hooks.noise_ema`; > 0).
      peak_flops_per_device: the accelerator's peak FLOP/s per device, for ``perf/mfu``;
        null logs the achieved ``perf/flops_per_sec`` only (`trainers.hooks.perf`).
      run_names: how sweep job folders and TensorBoard runs are named
        (`trainers.config.run_names`): "short" (the job number, each key's last component,
        floats to 3 digits: ``3_every_steps=16,learning_rate=0.617``) or "overrides" (the
        overrides as typed); the full overrides are in HParams and ``result.json`` either way.
      tensorboard, wandb, mlflow, csv: each logger's node, set by its option of the
        ``logger`` group (``logger=[tensorboard,wandb]``); null: that logger is off.
    """

    flush_secs: float = 10
    on_error: str = "stop"
    noise_ema_steps: float = 50
    peak_flops_per_device: float | None = None
    run_names: str = SHORT
    tensorboard: TensorBoardLogger | None = None
    wandb: WandbLogger | None = None
    mlflow: MlflowLogger | None = None
    csv: CsvLogger | None = None

    @classmethod
    def from_config(cls, node: Any) -> LoggerOptions:
        """Reads the ``logger`` node (`read_node`: one-line errors naming the key)."""
        return read_node(cls, node, "logger")

    def __post_init__(self) -> None:
        finite_positive(self.flush_secs, "logger.flush_secs", "the flush period in seconds")
        if self.on_error not in ON_ERROR:
            raise ConfigError(
                f"logger.on_error={self.on_error!r}: expected one of {list(ON_ERROR)}."
            )
        finite_positive(
            self.noise_ema_steps, "logger.noise_ema_steps", "the averaging time in steps"
        )
        check_style(self.run_names)
        for name in self.selected:
            check_installed(name)
        if self.peak_flops_per_device is not None:
            finite_positive(
                self.peak_flops_per_device,
                "logger.peak_flops_per_device",
                "the peak FLOP/s of one device (or null)",
            )

    @property
    def selected(self) -> tuple[str, ...]:
        """The loggers this run writes to, by name."""
        return tuple(n for n in ("tensorboard", "wandb", "mlflow", "csv") if getattr(self, n))
