"""``logger=wandb``: the run as a Weights & Biases run (``pip install 'xshard[wandb]'``).

The hyperparameters are the W&B config (the keys TensorBoard's HParams shows, e.g.
``optimizer.learning_rate``), the resolved config is a file of the run
(``xshard_config.yaml``), the scalars are logged at their step and the run's summary
(``hparams/*``) is the W&B summary. ``logger.wandb.mode=offline`` (or ``WANDB_MODE=offline``)
writes to ``<logger.wandb.dir>/wandb/`` only; ``wandb sync`` uploads it later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainers.config.loggers import WandbLogger
from trainers.hooks.log_sink import LogSink, RunInfo
from trainers.rundir.links import write_file
from trainers.rundir.outputs import Folder, Outputs

CONFIG_FILE = "xshard_config.yaml"


class WandbSink(LogSink):
    """A `trainers.hooks.log_sink.LogSink` writing to a W&B run."""

    name = "wandb"

    def __init__(self, options: WandbLogger):
        self.options = options
        self.destination = f"logger.wandb.dir={options.dir!r}"
        self.run: Any = None

    def outputs(self) -> Outputs:
        """W&B's folder, ``<logger.wandb.dir>/wandb/``, and its entries: W&B writes a new run
        folder there (a fresh id) and replaces its ``latest-run`` and ``debug*.log`` links.
        Deeper entries are earlier runs', never written again; W&B links their
        ``logs/debug-core.log`` to its own cache, outside the run dir."""
        folder = os.path.join(self.options.dir, "wandb")
        return Outputs(folders=(Folder(folder, "logger.wandb.dir", depth=1),))

    def start(self, run: RunInfo) -> None:
        import wandb

        opts = self.options
        Path(opts.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=opts.project,
            entity=opts.entity,
            mode=opts.mode,  # type: ignore[arg-type]
            name=opts.name or run.name,
            dir=opts.dir,
            tags=list(opts.tags),
            config=run.hparams,
            reinit="create_new",  # each job of a multirun in one process is its own run
        )
        write_file(Path(self.run.dir) / CONFIG_FILE, run.config_yaml)
        self.run.save(str(Path(self.run.dir) / CONFIG_FILE), base_path=self.run.dir)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(scalars), step=step)

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        if self.run is None:
            return
        self.run.summary.update(dict(summary))
        self.run.finish(exit_code=0 if success else 1)
        self.run = None
