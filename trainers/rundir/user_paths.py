"""Paths a user typed, resolved against the directory they typed them in.

A relative path on the command line (``trainer.resume_from=runs/a``,
``python -m trainers.evaluate ../runs/a``, ``trainers.load("runs/a")``) means the directory
the user's command ran in, whatever the process's working directory is by the time the path
is used: Hydra changes into the run dir with ``hydra.job.chdir=true``, and a multirun job
may run elsewhere. So a config key's path is resolved against `launch_dir` (Hydra's
``hydra.runtime.cwd``, the directory of the user's command, read by
`trainers.config.cli_args.launch_dir`), a path given to the Python API
or to ``python -m trainers.evaluate`` against the working directory at the call; ``~`` is
expanded, ``..`` and ``.`` are folded. Orbax needs absolute paths, and a relative one would
otherwise name another directory after a change of working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainers.config.cli_args import launch_dir

__all__ = ["launch_dir", "user_path"]


def user_path(value: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """`value` as an absolute path: ``~`` expanded, relative to `base` (None: the working
    directory now), ``.`` and ``..`` folded (lexically, as `os.path.abspath` does).

    Args:
      value: a path as the user typed it.
      base: the directory it was typed in (`launch_dir` for a config key).

    Returns:
      The absolute path.
    """
    path = Path(os.path.expanduser(os.fspath(value)))
    if not path.is_absolute():
        path = Path(base if base is not None else os.getcwd()) / path
    return Path(os.path.normpath(path))
