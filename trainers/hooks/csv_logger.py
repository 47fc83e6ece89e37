"""``logger=csv``: one CSV file of scalars per run, rows ``step,name,value``.

Long rows (one scalar a row) hold every scalar of the run whatever it logs when: training
steps, evaluations (``eval/*``) and, at the end, the summary (``hparams/*``, at the last step).
``pandas.read_csv(path).pivot_table(index="step", columns="name", values="value")`` gives one
column per scalar. The resolved config and the hyperparameters go beside it, as
``<file>.config.yaml`` and ``<file>.hparams.json``. A rerun that resumes appends to the file.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from trainers.hooks.log_sink import LogSink, RunInfo
from trainers.rundir.links import write_file
from trainers.rundir.outputs import Outputs, open_appended

HEADER = ("step", "name", "value")


def config_file(path: Path) -> Path:
    """The resolved config's file beside the CSV file `path` (``metrics.config.yaml``)."""
    return path.with_suffix(".config.yaml")


def hparams_file(path: Path) -> Path:
    """The hyperparameters' file beside the CSV file `path` (``metrics.hparams.json``)."""
    return path.with_suffix(".hparams.json")


class CsvSink(LogSink):
    """A `trainers.hooks.log_sink.LogSink` writing to the CSV file `path`.

    The CSV file is appended to, never through a link (`trainers.rundir.outputs`); the config
    and hparams files are written anew (a link in their place is replaced, not followed). A
    failed write (a full disk) closes the file and raises the `OSError`; nothing more is
    written (`trainers.hooks.run_logger.LoggerHook` decides what the run does).
    """

    name = "csv"

    def __init__(self, path: str):
        self.path = Path(path)
        self.destination = f"logger.csv.path={str(path)!r}"
        self._file: IO[str] | None = None

    def outputs(self) -> Outputs:
        """The CSV file (appended to), the config and hparams files (replaced)."""
        return Outputs(
            appended=(str(self.path),),
            replaced=(str(config_file(self.path)), str(hparams_file(self.path))),
        )

    def start(self, run: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_appended(self.path)
        try:
            fresh = os.fstat(fd).st_size == 0
            self._file = os.fdopen(fd, "a", newline="")
        except BaseException:
            os.close(fd)
            raise
        try:
            if fresh:
                csv.writer(self._file).writerow(HEADER)
                self._file.flush()
            write_file(config_file(self.path), run.config_yaml)
            hparams = json.dumps(run.hparams, indent=2, default=str)
            write_file(hparams_file(self.path), hparams + "\n")
        except BaseException:
            self._close()
            raise

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._file is None:
            return
        try:
            csv.writer(self._file).writerows((step, k, repr(float(v))) for k, v in scalars.items())
            self._file.flush()
        except OSError:
            self._close()
            raise

    def finish(self, summary: Mapping[str, float], success: bool) -> None:
        step = int(summary.get("hparams/last_step", 0))
        self.log_scalars(step, summary)
        self._close()

    def _close(self) -> None:
        """Closes the file; after a failed write its unwritten rows are dropped with it."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
