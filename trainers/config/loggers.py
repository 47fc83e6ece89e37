"""The loggers a run writes to: ``logger=tensorboard`` (the default), ``wandb``, ``mlflow``,
``csv``, or several at once (``logger=[tensorboard,wandb]``).

Each option of the ``logger`` group sets its own node under ``logger`` (``logger.wandb``, ...):
a logger is on when its node is set. The nodes' keys and defaults are the dataclasses below;
the keys every logger shares (``logger.log_every`` is ``trainer.log_every``; ``flush_secs``,
``on_error``, ``noise_ema_steps``, ``peak_flops_per_device``) stay in `LoggerOptions`
(`trainers.config.outputs`). W&B and MLflow are optional extras: selecting one without its
package is one line naming the pip extra (exit 2).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from xshard.config.nodes import LOCATION, shown
from xshard.errors import ConfigError

#: Logger name -> (the module it needs, the pip extra that installs it).
PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
#: W&B's modes (``wandb.init(mode=...)``).
WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass  # not frozen: a nested node (xshard.config.nodes.permissive)
class TensorBoardLogger:
    """``logger.tensorboard``: event files in ``paths.tb_dir`` (its keys are shared ones:
    ``logger.flush_secs``, ``logger.on_error``)."""


@dataclasses.dataclass  # not frozen: a nested node (xshard.config.nodes.permissive)
class WandbLogger:
    """``logger.wandb``: a Weights & Biases run.

    Attributes:
      project: the W&B project.
      entity: the W&B team or user; null: your default.
      mode: "online", "offline" (synced later with ``wandb sync``) or "disabled"; null: W&B's
        own default (``WANDB_MODE``).
      name: the run's name; null: the TensorBoard run folder's (the overrides).
      dir: where W&B keeps its files (``<dir>/wandb/``).
      tags: the run's tags.
    """

    project: str = "xshard"
    entity: str | None = None
    mode: str | None = None
    name: str | None = None
    dir: str = dataclasses.field(default="${paths.output_dir}", metadata=LOCATION)
    tags: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ConfigError(
                f"logger.wandb.mode={shown(self.mode)}: expected one of {list(WANDB_MODES)} "
                "or null (WANDB_MODE)."
            )


@dataclasses.dataclass  # not frozen: a nested node (xshard.config.nodes.permissive)
class MlflowLogger:
    """``logger.mlflow``: an MLflow run.

    Attributes:
      tracking_uri: the tracking server or store (``file:/path/mlruns``, ``http://...``); null:
        MLflow's default (``MLFLOW_TRACKING_URI``).
      experiment: the MLflow experiment (created if missing).
      run_name: the run's name; null: the TensorBoard run folder's (the overrides).
    """

    tracking_uri: str | None = dataclasses.field(default=None, metadata=LOCATION)
    experiment: str = "xshard"
    run_name: str | None = None


@dataclasses.dataclass  # not frozen: a nested node (xshard.config.nodes.permissive)
class CsvLogger:
    """``logger.csv``: one CSV file of scalars per run, rows ``step,name,value``.

    Attributes:
      path: the file (in the run's dir by default).
    """

    path: str = dataclasses.field(default="${paths.output_dir}/metrics.csv", metadata=LOCATION)


#: The ``logger`` group's options, by name: the node each one sets.
LOGGERS = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MlflowLogger,
    "csv": CsvLogger,
}


def check_installed(name: str) -> None:
    """Refuses a selected logger whose package is missing, naming the pip extra.

    Raises:
      ConfigError: ``logger=wandb needs the wandb package: pip install 'xshard[wandb]'``.
    """
    if name not in PACKAGES:
        return
    module, extra = PACKAGES[name]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"logger={name} needs the {module} package, which is not installed: "
            f"pip install 'xshard[{extra}]' (or choose another logger, e.g. logger=tensorboard)."
        )
