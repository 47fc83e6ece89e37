"""``logger=csv``: one CSV file of scalars per run, rows ``step,name,value``.

Long rows (one scalar a row) hold every scalar of the run whatever it logs when: training
steps, evaluations (``eval/*``) and, at the end, the summary (``hparams/*``, at the last step).
``pandas.read_csv(path).pivot_table(index="step", columns="name", values="value")`` gives one
column per scalar. The resolved config and the hyperparameters go beside it, as
``<file>.config.yaml`` and ``<file>.hparams.json``. A rerun that resumes appends to the file.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from trainers.hooks.run_logger import RunInfo

HEADER = ("step", "name", "value")


class CsvRunLogger:
    """A `trainers.hooks.run_logger.RunLogger` writing to the CSV file `path`."""

    name = "csv"

    def __init__(self, path: str):
        self.path = Path(path)
        self._file: IO[str] | None = None

    def start(self, run: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file = self.path.open("a", newline="")
        if fresh:
            csv.writer(self._file).writerow(HEADER)
        self.path.with_suffix(".config.yaml").write_text(run.config_yaml)
        hparams = json.dumps(run.hparams, indent=2, default=str)
        self.path.with_suffix(".hparams.json").write_text(hparams + "\n")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._file is None:
            return
        csv.writer(self._file).writerows((step, k, repr(float(v))) for k, v in scalars.items())
        self._file.flush()

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        step = int(summary.get("hparams/last_step", 0))
        self.log_scalars(step, summary)
        if self._file is not None:
            self._file.close()
            self._file = None
