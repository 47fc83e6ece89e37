"""One run directory for all processes: process 0's, shared, checked, and written by one.

Hydra gives each process its own ``hydra.run.dir``: the default ``outputs/<date>/<time>``
differs between hosts started a second apart, and on a TPU pod every host has its own disk.
Orbax, though, saves one checkpoint from all processes into one directory (each writes its
own shards; process 0 commits), and waits for all of them at the end of each save. So:

- `share_run_dirs` broadcasts process 0's ``paths.output_dir``, ``paths.checkpoint_dir`` and
  ``paths.tb_dir`` (absolute) to every process; the run uses process 0's checkpoint dir
  everywhere.
- `check_shared_dir` proves that every process sees that very directory, not a same-named
  local one: process 0 writes a file with a random name there, every other process must find
  it and write one of its own; else every process refuses to start, naming the directory,
  the process that cannot see it, and that process's own run dir.
- Only process 0 writes TensorBoard events, ``train.log`` and the config dump
  (``.hydra/``). Hydra has already set up logging and written ``.hydra/`` in every process
  before the run starts: a process other than 0 that shares process 0's output dir moves its
  log file to ``train.process-<i>.log`` (`separate_log`), and process 0 learns that another
  process shares its output dir (`RunDirs.output_shared`), so that the app writes the config
  dump again (`trainers.app.hydra_run.rewrite_config_dump`) and the one in the run dir is its
  own.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainers.cluster.multihost import Cluster
from trainers.rundir.log_file import RunLogFile
from trainers.rundir.user_paths import launch_dir, user_path
from xshard.errors import ConfigError

if TYPE_CHECKING:
    from trainers.config import PathsOptions

logger = logging.getLogger(__name__)

_PROBE = ".xshard-shared-"


@dataclasses.dataclass(frozen=True)
class RunDirs:
    """The directories a process of the run uses.

    Attributes:
      output_dir: this process's own output dir (``paths.output_dir``: its logs).
      lead_output_dir: process 0's output dir (the run's, which owns the checkpoints).
      checkpoint_dir: process 0's ``paths.checkpoint_dir``: every process saves there.
      tb_dir: process 0's ``paths.tb_dir`` (only process 0 writes events).
      output_shared: on process 0, whether another process has the same output dir (process 0
        then writes its config dump again: its own is the one the run dir keeps).
    """

    output_dir: str
    lead_output_dir: str
    checkpoint_dir: str
    tb_dir: str
    output_shared: bool = False


def absolute_path(path: Any) -> str:
    """`path` (a config value) as an absolute path, without resolving symlinks: relative to
    the directory of the user's command (`trainers.rundir.user_paths.launch_dir`)."""
    return str(user_path(str(path), launch_dir()))


def share_run_dirs(paths: PathsOptions, cluster: Cluster) -> RunDirs:
    """Process 0's directories on every process; only process 0 keeps the log file.

    Args:
      paths: this process's ``paths`` node.
      cluster: the run's processes.

    Returns:
      The directories this process uses (`RunDirs.output_shared`: process 0 writes the config
      dump again).
    """
    own = absolute_path(paths.output_dir)
    lead = cluster.broadcast(
        "paths",
        {
            "output_dir": own,
            "checkpoint_dir": absolute_path(paths.checkpoint_dir),
            "tb_dir": absolute_path(paths.tb_dir),
        },
    )
    outputs = cluster.all_gather("output_dirs", own)
    shared = cluster.lead and own in outputs[1:]
    if cluster.count > 1:
        if not cluster.lead and own == lead["output_dir"]:
            separate_log(cluster.index)
        logger.info(
            "Process %d of %d (%s): checkpoints in %s (process 0's), own output dir %s.",
            cluster.index,
            cluster.count,
            cluster.hosts[cluster.index],
            lead["checkpoint_dir"],
            own,
        )
    return RunDirs(own, lead["output_dir"], lead["checkpoint_dir"], lead["tb_dir"], shared)


def check_shared_dir(cluster: Cluster, directory: str, key: str, own_output_dir: str) -> None:
    """Checks that every process sees and can write process 0's existing `directory`.

    Args:
      cluster: the run's processes.
      directory: process 0's directory (created by process 0 before).
      key: its config key, for the message.
      own_output_dir: this process's own output dir, for the message.

    Raises:
      ConfigError: on a process that cannot see or write the directory (a local directory
        of the same name, not a shared filesystem), naming both directories.
      PeerError: on the other processes, naming the one that failed.
    """
    if cluster.count == 1:
        return
    path = Path(directory)
    problem = None
    token = None
    if cluster.lead:  # the file first: the others look for it once they know its name
        token = secrets.token_hex(8)
        try:
            (path / f"{_PROBE}{token}").write_text(token)
        except OSError as e:
            problem = f"cannot write there ({e.strerror or type(e).__name__})"
    token = cluster.broadcast(f"probe/{key}/token", token)
    if not cluster.lead:
        marker = path / f"{_PROBE}{token}"
        try:
            seen = marker.read_text() if marker.exists() else None
            if seen != token:
                problem = "cannot see it (the file process 0 wrote there is missing)"
            else:
                (path / f"{_PROBE}{token}-{cluster.index}").write_text(token)
        except OSError as e:
            problem = f"cannot write there ({e.strerror or type(e).__name__})"
    problems = cluster.all_gather(f"probe/{key}/seen", problem)
    if cluster.lead:
        for stale in path.glob(f"{_PROBE}{token}*"):
            stale.unlink(missing_ok=True)
    if problem is not None:
        raise ConfigError(
            f"{key}={directory!r} (process 0's) is not shared: {cluster.name(cluster.index)} "
            f"{problem}; its own run dir is {own_output_dir}. Every process writes its shards of "
            "each checkpoint into process 0's directory: it must be one directory on a "
            "filesystem all hosts share (NFS, Lustre, a GCS FUSE mount). Set hydra.run.dir, or "
            f"{key}, to such a path, the same on every host."
        )
    cluster.raise_for(problems, f"checking that it sees {key}={directory!r}")


def separate_log(index: int) -> None:
    """Moves this process's log file(s) from ``<name>.log`` to ``<name>.process-<index>.log``.

    Lines already written (those before the cluster formed) stay in the shared file.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler):
            continue
        old = Path(handler.baseFilename)
        new = RunLogFile(  # never written through a link (trainers/rundir/log_file.py)
            old.with_name(f"{old.stem}.process-{index}{old.suffix}"),
            mode="a",
            encoding=handler.encoding,
        )
        new.setLevel(handler.level)
        new.setFormatter(handler.formatter)
        for f in handler.filters:
            new.addFilter(f)
        root.addHandler(new)
        root.removeHandler(handler)
        handler.close()


def check_same_checkpoints(cluster: Cluster, source: Any) -> None:
    """Checks that every process found the same checkpoint to resume from.

    Args:
      cluster: the run's processes.
      source: this process's `trainers.checkpoint.resume.RestoreSource`, or None (start afresh).

    Raises:
      ConfigError: on every process, if one of them sees other checkpoints than process 0
        (not a shared filesystem), naming the directory and what each saw.
    """
    if cluster.count == 1:
        return
    from trainers.checkpoint.io import complete_steps

    mine = None
    if source is not None:
        mine = [str(source.directory), source.step, complete_steps(source.directory)]
    seen = cluster.all_gather("resume_source", mine)
    for i, theirs in enumerate(seen[1:], start=1):
        if theirs != seen[0]:
            raise ConfigError(
                f"The processes do not see the same checkpoints: process 0 resumes from "
                f"{_describe(seen[0])}, {cluster.name(i)} from {_describe(theirs)}. Every "
                "process must read process 0's checkpoint dir on a shared filesystem."
            )


def _describe(entry: list | None) -> str:
    if entry is None:
        return "nothing (a fresh start)"
    directory, step, steps = entry
    return f"{directory} (step {step if step is not None else 'latest'} of {steps})"
