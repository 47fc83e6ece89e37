"""``logger=mlflow``: the run as an MLflow run (``pip install 'xshard[mlflow]'``).

The hyperparameters are the run's params (the keys TensorBoard's HParams shows, e.g.
``optimizer.learning_rate``), the resolved config is an artifact (``config.yaml``), the scalars
are metrics at their step, the run's summary (``hparams/*``) is logged as metrics at the last
step, and the run ends FINISHED or FAILED. ``logger.mlflow.tracking_uri=file:/path/mlruns``
writes to a local store without a server.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from trainers.config.loggers import MlflowLogger
from trainers.hooks.log_sink import LogSink, RunInfo
from trainers.rundir.outputs import Folder, Outputs


class MlflowSink(LogSink):
    """A `trainers.hooks.log_sink.LogSink` writing to an MLflow run."""

    name = "mlflow"

    def __init__(self, options: MlflowLogger):
        self.options = options
        self.destination = f"logger.mlflow.tracking_uri={options.tracking_uri!r}"
        self.client: Any = None
        self.run_id: str | None = None

    def outputs(self) -> Outputs:
        """A local file store's folder (``file:/path/mlruns``); nothing for a server."""
        uri = self.options.tracking_uri
        if uri is None or urlparse(uri).scheme != "file":
            return Outputs()
        return Outputs(folders=(Folder(urlparse(uri).path, "logger.mlflow.tracking_uri"),))

    def start(self, run: RunInfo) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        opts = self.options
        self.client = MlflowClient(tracking_uri=opts.tracking_uri)
        experiment = self.client.get_experiment_by_name(opts.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(opts.experiment)
        )
        created = self.client.create_run(experiment_id, run_name=opts.run_name or run.name)
        self.run_id = created.info.run_id
        # `log_batch` splits what exceeds MLflow's limits per request itself.
        params = [Param(k, str(v)) for k, v in run.hparams.items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_text(self.run_id, run.config_yaml, "config.yaml")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        if self.run_id is None:
            return
        self.log_scalars(int(summary.get("hparams/last_step", 0)), summary)
        self.client.set_terminated(self.run_id, "FINISHED" if success else "FAILED")
        self.run_id = None
