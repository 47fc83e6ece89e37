"""How a job ends, single run or multirun: its closing lines, ``result.json``, the sweep table.

A single run keeps its exit statuses (``trainers/train.py``). In a multirun a job that fails or
diverges must not end the sweep: Hydra's job runner does not catch `SystemExit`, so one
``sys.exit(3)`` would stop every job after it. Instead the job records what happened in
``<job output dir>/result.json`` (and its TensorBoard HParams entry says "failure") and
returns to the sweeper (`failed_job_value`):

- ``trainer.failed_objective`` set (a number): that value, as the trial's objective; an
  optimizing sweeper then learns that this region is bad (e.g. 1e9 when minimising);
- otherwise, Hydra's basic sweeper (which uses no objective): None, and the sweep goes on;
- otherwise (an optimizing sweeper such as Optuna): `TrialFailed` is raised. Hydra's job
  runner records the job as failed, and the Optuna sweeper counts it as a failed trial against
  ``hydra.sweeper.max_failure_rate``, which xshard sets to 1.0 unless you chose it: failed
  trials do not end the study (`trainers.app.failed_trials`).

The sweeper never gets NaN or inf: a job whose final loss is not finite is a failed trial too.
`SweepSummary` (a Hydra callback, registered in ``xshard_train.yaml``) prints a table of the
jobs (overrides, status, objective) when the multirun ends and writes it to the sweep dir,
with a figure of the objective against each swept key where matplotlib is installed
(`trainers.app.sweep_plot`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from trainers.app.sweep_plot import PLOTS_EXTRA, SWEEP_FIGURE_FILE, write_objective_figure
from trainers.config.cli_args import override_key
from trainers.exits import TrialFailed
from trainers.hooks.summary import COMPLETED, RunSummary
from trainers.rundir.links import write_file
from trainers.rundir.log_file import log_to_files

log = logging.getLogger("trainers.train")

#: A job's outcome, in its output dir.
RESULT_FILE = "result.json"
#: The sweep's table of jobs, in the sweep dir.
SWEEP_SUMMARY_FILE = "sweep_summary.md"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def is_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job() -> dict[str, Any]:
    """The running job's number, overrides and sweeper, from Hydra's config."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"num": 0, "overrides": [], "sweeper": None}
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    excluded = set(hc.job.config.override_dirname.exclude_keys)

    return {
        # Hydra types hc.job as its JobConf dataclass; it is a DictConfig node.
        "num": int(cast(DictConfig, hc.job).get("num", 0) or 0),
        "overrides": overrides,
        # What the run's name shows: not Hydra's own keys nor those left out of dir names.
        "shown_overrides": [
            o
            for o in overrides
            if override_key(o) not in excluded and not override_key(o).startswith("hydra")
        ],
        "sweeper": hc.sweeper.get("_target_"),
    }


def write_result(output_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Writes `record` as ``<output_dir>/result.json``: atomically (no half-written file, no
    temporary file left behind) and never through a symbolic link (`write_file`).

    If it cannot be written (a full disk), a ``result.json`` already there (an earlier run's)
    is removed, so that it is not taken for this run's outcome, and the write is tried once
    more: the space that file held may be enough.

    Returns:
      The file's path.

    Raises:
      OSError: the first write's error, if the file could not be written; there is no
        ``result.json`` then.
    """
    path = Path(output_dir) / RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(record, indent=2, default=str) + "\n"
    try:
        return write_file(path, data)
    except OSError as first:
        try:
            path.unlink()
            return write_file(path, data)
        except OSError:
            raise first from None


def finish_job(
    cfg: DictConfig, summary: RunSummary, status: str, error: BaseException | None = None
) -> dict[str, Any]:
    """Logs the run's closing lines and writes its ``result.json`` (process 0 only).

    Args:
      cfg: the run's config (``paths``).
      summary: what the run did.
      status: how it ended (`trainers.hooks.summary` statuses).
      error: the error that ended it, if any.

    Returns:
      The job's record (as written to ``result.json``), with its ``objective``: the final
      loss if the run completed with a finite one, else None.
    """
    from xshard.config import one_line

    message = one_line(str(error)) if error is not None else None
    record = {**_job(), **summary.record(status, message)}
    record["objective"] = summary.objective if status == COMPLETED else None
    record["written_at"] = time.time()
    record["pid"] = os.getpid()
    if not _lead(summary):
        return record
    warn = status != COMPLETED or summary.skipped or record["objective"] is None
    for line in summary.lines(status):
        log.log(logging.WARNING if warn and summary.started else logging.INFO, "%s", line)
    try:
        if summary.started:
            tb = cfg.paths.tb_dir
            log.info("TensorBoard logs: %s  (view: tensorboard --logdir %s)", tb, Path(tb).parent)
        write_result(cfg.paths.output_dir, record)
    except Exception as e:  # a full disk or a bad path must not hide the outcome
        # One line on stderr (scripts look for result.json), before the run's error line.
        reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(str(e))
        message = (
            f"The run's {RESULT_FILE} could not be written in {cfg.paths.output_dir} ({reason}): "
            "there is none for this run."
        )
        log_to_files(log, logging.WARNING, message)
        print(f"xshard: warning: {message}", file=sys.stderr, flush=True)
    return record


def _lead(summary: RunSummary) -> bool:
    """Whether this is process 0. JAX is only asked once the run initialised it: a job that
    failed earlier must not initialise a backend the next job of the sweep needs to set up."""
    if not summary.started:
        return True
    import jax

    return jax.process_index() == 0


def failed_job_value(record: dict[str, Any], failed_objective: float | None) -> float | None:
    """What a multirun job that did not give a finite objective returns to its sweeper.

    Args:
      record: the job's record (`finish_job`).
      failed_objective: ``trainer.failed_objective`` (None: report a failed trial).

    Returns:
      `failed_objective` if set; None under Hydra's basic sweeper (it uses no objective).

    Raises:
      TrialFailed: under any other sweeper, with the job's status and reason.
    """
    log.warning(
        "Job %d %s at step %d: %s",
        record["num"],
        record["status"],
        record["last_step"],
        record["reason"] or "the final loss is not finite",
    )
    if isinstance(failed_objective, int | float) and math.isfinite(failed_objective):
        return float(failed_objective)
    if record["sweeper"] in (None, BASIC_SWEEPER):
        return None
    raise TrialFailed(
        f"{record['status']} at step {record['last_step']}: "
        f"{record['reason'] or 'the final loss is not finite'}"
    )


# ------------------------------------------------------------------ the sweep's table


class SweepSummary(Callback):
    """Prints a table of the multirun's jobs at its end and writes it to the sweep dir, with
    the figure of `trainers.app.sweep_plot` next to it (skipped, with one log line per sweep,
    where matplotlib is not installed).

    Reads each job's ``result.json`` under ``hydra.sweep.dir`` (jobs may have run in other
    processes: ``submitit``), keeping those written since this multirun started. A job killed
    before it could write one is missing from the table. The file is also rewritten after each
    job that ran in this process, so that a sweep the sweeper ends early (an Optuna study over
    its ``max_failure_rate``) still leaves its table.
    """

    def __init__(self) -> None:
        self._started = time.time()
        self._in_this_process = False  # whether this process started the multirun
        self._figure_skipped = False  # whether the missing matplotlib was logged

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started = time.time()
        self._in_this_process = True
        self._figure_skipped = False

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self._in_this_process:
            self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        table, figure = self._write(config)
        print(table, flush=True)
        print(f"Sweep summary: {sweep_dir / SWEEP_SUMMARY_FILE}", flush=True)
        if figure is not None:
            print(f"Sweep figure: {figure}", flush=True)
        print(f"TensorBoard: tensorboard --logdir {sweep_dir / 'tb'}", flush=True)

    def _write(self, config: DictConfig) -> tuple[str, Path | None]:
        """Writes the table of the jobs so far to the sweep dir, and its figure; returns the
        table and the figure's path (None: not written)."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        records = collect_results(sweep_dir, since=self._started)
        direction = config.hydra.sweeper.get("direction", "minimize")
        table = sweep_table(records, maximize=str(direction) == "maximize")
        try:  # never through a link planted in a copied sweep dir
            write_file(sweep_dir / SWEEP_SUMMARY_FILE, table + "\n")
        except OSError as e:
            log.warning("Could not write %s: %s", sweep_dir / SWEEP_SUMMARY_FILE, e)
        figure = self._write_figure(
            sweep_dir / SWEEP_FIGURE_FILE, records, str(direction) == "maximize"
        )
        return table, figure

    def _write_figure(
        self, path: Path, records: list[dict[str, Any]], maximize: bool
    ) -> Path | None:
        """Writes the sweep's figure to `path` (None: not written, no job with a finite
        objective yet); without matplotlib, says once per sweep that it is skipped. A figure
        that cannot be drawn or written never ends the sweep."""
        try:
            return write_objective_figure(records, path, maximize=maximize)
        except ImportError:
            if not self._figure_skipped:
                self._figure_skipped = True
                log.info(
                    "Sweep figure %s skipped: matplotlib is not installed (%s).",
                    path.name,
                    PLOTS_EXTRA,
                )
        except Exception as e:  # a figure is an extra; the table is written
            log.warning("Could not write %s: %s", path, e)
        return None


def collect_results(sweep_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """The ``result.json`` records under `sweep_dir` written at or after `since`, by job."""
    records = []
    for path in sorted(sweep_dir.rglob(RESULT_FILE)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("written_at", 0) >= since:
            record["dir"] = str(path.parent)
            records.append(record)
    return sorted(records, key=lambda r: (r.get("num", 0), r["dir"]))


def sweep_table(records: list[dict[str, Any]], *, maximize: bool = False) -> str:
    """A Markdown table of the jobs: overrides, status, objective, last step; best marked."""
    objectives = [
        r["objective"]
        for r in records
        if isinstance(r.get("objective"), int | float) and math.isfinite(r["objective"])
    ]
    best = (max if maximize else min)(objectives) if objectives else None
    rows = [
        "| job | overrides | status | objective | last step | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        objective = r.get("objective")
        shown = "-" if objective is None else f"{objective:.5g}"
        if best is not None and objective == best:
            shown += " (best)"
        reason = "" if r.get("status") == COMPLETED else str(r.get("reason") or "")
        cells = [
            str(r.get("num", "")),
            " ".join(r.get("shown_overrides", r.get("overrides")) or []) or "(none)",
            str(r.get("status")),
            shown,
            f"{r.get('last_step')}/{r.get('num_steps')}",
            reason[:120].replace("|", "/"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    done = sum(r.get("status") == COMPLETED for r in records)
    rows.append("")
    rows.append(f"{len(records)} jobs: {done} completed, {len(records) - done} did not.")
    return "\n".join(rows)
