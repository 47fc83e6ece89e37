"""`run(cfg)`: the body of a Hydra main that trains, with the documented exit statuses.

``python -m trainers.train`` is `run` under xshard's own ``@hydra.main``; your own
``@hydra.main`` calls it the same way (docs/config.md). The exit statuses and what a multirun
job does instead of exiting are in `trainers.train`'s docstring and docs/sweeps.md.
"""

from __future__ import annotations

import logging
import sys

from omegaconf import DictConfig

from trainers.cluster.multihost import exit_process, report_unexpected
from trainers.exits import EXIT_CONFIG_ERROR, EXIT_PREEMPTED
from trainers.hooks.summary import RunSummary
from trainers.rundir.log_file import log_to_files

log = logging.getLogger("trainers.train")


def _exit(error: BaseException, code: int, label: str = "error") -> None:
    """Reports `error` in one line (stderr, and the log file) and exits with `code`: with
    several processes, after telling the others (`trainers.cluster.multihost.exit_process`).

    The line goes to the log file only, not to the console handler too: on a terminal the
    error shows once.
    """
    from xshard.config import one_line

    message = one_line(str(error))
    log_to_files(log, logging.WARNING if code == EXIT_PREEMPTED else logging.ERROR, message)
    print(f"xshard: {label}: {message}", file=sys.stderr)
    exit_process(code)


def run(cfg: DictConfig) -> float | None:
    """Trains `cfg` as ``python -m trainers.train`` does: the body of a Hydra main.

    Call it from your own ``@hydra.main`` (whose primary config composes ``xshard_train``) to
    keep the documented exit statuses (module docstring) and one-line errors; `train` raises
    instead. It must run inside a Hydra app: it reads the job's Hydra config.

        @hydra.main(config_path="conf", config_name="my_exp", version_base="1.3")
        def main(cfg):
            return trainers.run(cfg)

    Args:
      cfg: the composed config of the job.

    Returns:
      The run's objective (``trainer.objective``: the final training loss by default, or a
      metric of the final evaluation), for optimizing sweepers. In a multirun a failed or
      diverged job returns `trainers.app.sweep.failed_job_value` instead of exiting.

    Raises:
      SystemExit: with the documented status, after one line on stderr (single runs; a
        signal in a multirun too).
      TrialFailed: a failed job of an optimizing sweeper's multirun (`trainers.app.sweep`).
      Exception: an unexpected error (a bug), with its traceback: exit status 1.
    """
    from trainers.app.allowlist import add_trusted_entries, check_allowlist_sources
    from trainers.app.sweep import finish_job
    from trainers.app.training import train
    from trainers.exits import (
        EXIT_NONFINITE,
        EXIT_PEER_LOST,
        CheckpointError,
        GroupLost,
        LoggerError,
        NonFiniteError,
        Preempted,
    )
    from trainers.hooks import summary as status
    from xshard.errors import ConfigError

    summary = RunSummary()
    try:
        check_allowlist_sources(cfg)  # no copied config file widens the allowlist
        add_trusted_entries(cfg)  # the primary config, XSHARD_ALLOWED_TARGETS, packages
        train(cfg, summary)
    except Preempted as e:  # stops a multirun too: the machine is going away
        finish_job(cfg, summary, status.PREEMPTED, e)
        _exit(e, EXIT_PREEMPTED, label="preempted")
    except NonFiniteError as e:
        return _failed(cfg, summary, e, status.DIVERGED, EXIT_NONFINITE)
    except GroupLost as e:  # an elastic group: restarted, it rejoins from a live peer
        return _failed(cfg, summary, e, status.FAILED, EXIT_PEER_LOST)
    except (ConfigError, CheckpointError, LoggerError) as e:  # name the key, value, what's allowed
        return _failed(cfg, summary, e, status.FAILED, EXIT_CONFIG_ERROR)
    except Exception as e:
        finish_job(cfg, summary, status.CRASHED, e)
        report_unexpected(e)  # several processes: traceback in the log, exit 1 without waiting
        raise
    return _completed(cfg, summary)


def _failed(
    cfg: DictConfig, summary: RunSummary, error: BaseException, kind: str, code: int
) -> float | None:
    """A run that ended with `error`: recorded as `kind`; a single run exits with `code`, a
    multirun job returns what a failed job returns to the sweeper."""
    from trainers.app.sweep import failed_job_value, finish_job, is_multirun

    record = finish_job(cfg, summary, kind, error)
    if not is_multirun():
        _exit(error, code)
    return failed_job_value(record, cfg.trainer.get("failed_objective"))


def _completed(cfg: DictConfig, summary: RunSummary) -> float | None:
    """A run that trained to its end: recorded; its objective (never NaN or inf to a sweeper:
    a multirun job without one returns what a failed job returns)."""
    from trainers.app.sweep import failed_job_value, finish_job, is_multirun
    from trainers.hooks import summary as status

    record = finish_job(cfg, summary, status.COMPLETED)
    if record["objective"] is None and is_multirun():
        return failed_job_value(record, cfg.trainer.get("failed_objective"))
    return record["objective"] if record["objective"] is not None else summary.final_loss
