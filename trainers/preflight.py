"""Checks done before any training work: can the run write where its config says?

Hydra creates the run's output directory itself, before the task function runs, and fails
with a traceback when it cannot. `OutputDirCheck` is a Hydra callback (registered under
``hydra.callbacks`` in ``xshard_train.yaml``) that checks the directory first and exits with
one line and status 2; `check_writable_dir` does the same check for the run's own output
paths (``paths.tb_dir``, ``paths.checkpoint_dir``) inside `train.py`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from xshard.errors import ConfigError

#: Exit status of a configuration or input error (as `train.py`'s EXIT_CONFIG_ERROR).
EXIT_CONFIG_ERROR = 2


def check_writable_dir(path: str | os.PathLike, key: str) -> Path:
    """Creates the directory `path` if needed and checks that a file can be written in it.

    Args:
      path: the directory.
      key: the config key `path` came from, for the error message.

    Returns:
      `path` as a `Path`.

    Raises:
      ConfigError: naming `key` and `path` if the directory cannot be created or written.
    """
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(
            f"{key}={str(path)!r} cannot be written ({reason}: {e.filename or path}). "
            f"Set {key} to a writable directory."
        ) from e
    return directory


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
        except ConfigError as e:
            print(f"xshard: error: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
