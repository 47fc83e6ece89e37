"""Checks done before any training work: can the run write where its config says?

Hydra creates the run's output directory itself, before the task function runs, and fails
with a traceback when it cannot. `OutputDirCheck` is a Hydra callback (registered under
``hydra.callbacks`` in ``xshard_train.yaml``) that checks the directory first and exits with
one line and status 2; `check_writable_dir` does the same check for the run's own output
paths (``paths.tb_dir``, ``paths.checkpoint_dir``) inside `train.py`. An empty file needs no
space, so a full disk passes that check: `check_free_space` compares the free space with what
the run will write (`trainers.checkpoint.io.check_checkpoint_space`; `OutputDirCheck` asks for
`OUTPUT_DIR_MIN_FREE` in the output dir). `RunDirLinksCheck`, a Hydra callback too, refuses a
link in the run dir that would take Hydra's config dump or log file out of it
(`trainers.rundir.links`).
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from trainers.exits import EXIT_CONFIG_ERROR, LinkOutOfRunDirError
from trainers.rundir.disk import OUTPUT_DIR_MIN_FREE, check_free_space, check_writable_dir
from trainers.rundir.links import check_run_dir, check_sweep_dir
from xshard.errors import ConfigError


class OutputDirCheck(Callback):
    """Hydra callback: exits with status 2 and one line if the output dir is not writable."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")

    @staticmethod
    def _check(path: str, key: str) -> None:
        try:
            check_writable_dir(path, key)
            # A full disk: one line here, not Hydra's traceback when its config dump fails.
            check_free_space(
                path,
                OUTPUT_DIR_MIN_FREE,
                key,
                what="its config dump (.hydra/), log file and result.json",
            )
        except ConfigError as e:
            print(f"xshard: error: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)


def job_log_files(config: DictConfig, output_dir: str) -> list[str]:
    """The files that ``hydra.job_logging``'s handlers will write for a job in `output_dir`."""
    logging_cfg = config.hydra.get("job_logging")
    if not isinstance(logging_cfg, DictConfig) or not logging_cfg.get("handlers"):
        return []
    cfg = copy.deepcopy(config)
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.runtime.output_dir = output_dir
    files = []
    for handler in cfg.hydra.job_logging.handlers.values():
        try:
            name = handler.get("filename") if isinstance(handler, DictConfig) else None
        except OmegaConfBaseException:  # not resolvable before the job runs: the job checks it
            continue
        if isinstance(name, str):
            files.append(os.path.join(output_dir, name))
    return files


def _hydra_subdir(config: DictConfig) -> str | None:
    subdir = OmegaConf.select(config, "hydra.output_subdir")
    return None if subdir is None else str(subdir)


class RunDirLinksCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in ``xshard_train.yaml``): exits 2 with one line if
    a link in the run dir (a sweep dir) would take Hydra's config dump or the log file out of
    it, before Hydra writes either (`check_run_dir`, `check_sweep_dir`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = os.path.abspath(str(config.hydra.run.dir))
        self._refuse_on(
            lambda: check_run_dir(
                run_dir,
                hydra_subdir=_hydra_subdir(config),
                log_files=job_log_files(config, run_dir),
            )
        )

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = os.path.abspath(str(config.hydra.sweep.dir))
        names = [os.path.basename(f) for f in job_log_files(config, sweep_dir)]
        self._refuse_on(lambda: check_sweep_dir(sweep_dir, _hydra_subdir(config), names))

    @staticmethod
    def _refuse_on(check: Any) -> None:
        from xshard.config import one_line

        try:
            check()
        except LinkOutOfRunDirError as e:
            print(f"xshard: error: {one_line(str(e))}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)


def host_memoryhuman_bytes() -> int:
    """Physical memory of this host, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_batch_fits(
    make_batches: Callable[[int], Iterator[Mapping[str, Any]]],
    global_batch: int,
    *,
    probe_batch: int,
    process_count: int = 1,
    key: str = "trainer.batch_size",
) -> None:
    """Refuses a global batch whose host-local share cannot fit in this host's memory.

    The bytes per example are measured on a small batch of the task's own data
    (`probe_batch` examples, a multiple of the number of processes), so no task needs to
    declare them.

    Args:
      make_batches: ``global_batch_size -> iterator of this process's batches``.
      global_batch: the configured global batch size.
      probe_batch: the global size of the probe batch.
      process_count: processes sharing the global batch.
      key: the config key of `global_batch`, for the error message.

    Raises:
      ConfigError: naming `key` and the value, if one batch needs more than half of the
        host's physical memory.
    """
    try:
        probe = next(iter(make_batches(probe_batch)), None)
    except ConfigError:  # data refusing the probe's size refuses the real one too, by name
        return
    if probe is None:  # finite data smaller than the probe: the caller reports it
        return
    per_example = sum(np.asarray(x).nbytes for x in probe.values()) / (probe_batch // process_count)
    need = per_example * global_batch / process_count
    have = host_memoryhuman_bytes()
    if need > have / 2:
        raise ConfigError(
            f"{key}={global_batch} needs {human_bytes(need)} of host memory for one batch "
            f"({human_bytes(per_example)} per example, {process_count} process(es)), more than "
            f"half of this host's {human_bytes(have)}. Choose a smaller {key}."
        )


def human_bytes(n: float) -> str:
    """`n` bytes as people read them: "745.0 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
