"""One run per checkpoint directory: a lock while the run lives, and an owner record.

Orbax's `CheckpointManager` prunes every step folder of its directory beyond ``keep``, whoever
wrote it, and two managers on one directory race. So before a run reads its checkpoint
directory (``paths.checkpoint_dir``), `claim_checkpoint_dir`, called by process 0 only:

1. refuses the directory if it belongs to another run (`ForeignCheckpointDirError`), having
   only read it;
2. takes an exclusive ``fcntl.flock`` on ``<dir>/xshard.lock`` and writes who holds it (host,
   pid, start time, output dir) into that file; if another live process holds the lock, it
   refuses (`CheckpointDirInUseError`), naming the holder. The lock is held until the process
   ends (released at exit; the OS releases it when a process dies, even by ``kill -9``, so a
   leftover lock file is not a lock);
3. checks ownership again under the lock and records this run as the owner in
   ``<dir>/xshard-owner.json``: ``{"format", "output_dir", "checkpoint_dir", "host", "updated"}``.

A run owns its checkpoint directory when (paths resolved, `owns`):

- the owner record names this run's output dir (``paths.output_dir``); or
- the directory lies inside this run's output dir and the record was written for another
  path (the run dir was copied or moved: the record is updated); or
- there is no readable record and the directory holds no step folders (a new or empty dir),
  or lies inside this run's output dir (checkpoints written before owner records existed).

Both files are plain files next to the step folders; Orbax lists step *directories* only
(``ocp.path.step.checkpoint_steps``, the manager's pruning and tmp cleanup ignore them).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainers.exits import CheckpointDirInUseError, ForeignCheckpointDirError
from trainers.rundir.disk import check_writable_dir
from trainers.rundir.links import write_file
from xshard.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = "xshard.lock"
OWNER_FILE = "xshard-owner.json"
OWNER_FORMAT = "xshard.checkpoint-owner/1"


@dataclasses.dataclass
class CheckpointDirLock:
    """The exclusive lock on one checkpoint directory, held by this process.

    Attributes:
      directory: the checkpoint directory (resolved).
      fd: the open lock file (None once released).
    """

    directory: Path
    fd: int | None

    def release(self) -> None:
        """Unlocks and closes the lock file (idempotent); the file itself stays."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            _HELD.pop(self.directory, None)
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


#: Locks this process holds, by directory: a second claim in one process reuses its lock.
# Process state: ``flock`` locks belong to the process (a second lock of the same file in it
# would fail), are released at its exit, and outlive the run that claimed them (a multirun).
_HELD: dict[Path, CheckpointDirLock] = {}


def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock.release()


atexit.register(_release_all)


def claim_checkpoint_dir(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    lead: bool = True,
    create: bool = True,
) -> CheckpointDirLock | None:
    """Makes sure this run may use `checkpoint_dir`, locks it and records this run as owner.

    Nothing is read from or written to the directory's checkpoints; on an error nothing at all
    is written there.

    Args:
      checkpoint_dir: the run's ``paths.checkpoint_dir``.
      output_dir: the run's ``paths.output_dir`` (what identifies the run).
      lead: whether this is process 0; other processes do nothing and return None.
      create: whether the run writes checkpoints (``checkpoint.enabled``). If not, a missing
        directory is left missing and an unwritable one is used unlocked.

    Returns:
      The lock (held until the process ends, or `CheckpointDirLock.release`), or None if
      nothing was locked.

    Raises:
      ForeignCheckpointDirError: if the directory belongs to another run.
      CheckpointDirInUseError: if another live process holds its lock.
      ConfigError: if the directory cannot be created or written (and `create`).
    """
    if not lead:
        return None
    here, out = _resolve(checkpoint_dir), _resolve(output_dir)
    if not here.exists() and not create:
        return None
    check_ownership(here, out)  # before writing anything there, the lock file included
    held = _HELD.get(here)
    lock = held or _acquire(here, out, create=create)
    if lock is None:
        return None
    try:
        check_ownership(here, out)  # again: another run may have claimed it before our lock
    except ForeignCheckpointDirError:
        if held is None:
            lock.release()
        raise
    record = read_owner(here)
    if record is None or (record["output_dir"], record.get("checkpoint_dir")) != (
        str(out),
        str(here),
    ):
        _write_owner(here, out)
    return lock


def check_ownership(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike) -> None:
    """Raises unless the run with `output_dir` owns `checkpoint_dir` (see `owns`); reads only.

    Raises:
      ForeignCheckpointDirError: naming the owner's output dir and how to proceed.
    """
    here, out = _resolve(checkpoint_dir), _resolve(output_dir)
    record = read_owner(here)
    if owns(here, out, record):
        return
    if record is not None:
        owner = str(record["output_dir"])
        whose = f"another run (output dir {owner})"
    else:  # written before owner records: in the default layout, the run dir is the parent
        owner = str(here.parent) if here.name == "checkpoints" else "<that run's dir>"
        whose = f"another run (no owner record; not inside this run's output dir {out})"
    what = "holds checkpoints of" if _has_subdirs(here) else "belongs to"
    raise ForeignCheckpointDirError(
        f"paths.checkpoint_dir={str(here)!r} {what} {whose}; nothing was changed there (a "
        "checkpoint dir belongs to one run, the only one that prunes it). To start from them, "
        f"set trainer.resume_from={str(here)!r} with a fresh paths.checkpoint_dir (the "
        f"default, inside this run's output dir); to continue that run, set hydra.run.dir={owner}."
    )


def owns(checkpoint_dir: Path, output_dir: Path, record: Mapping[str, Any] | None) -> bool:
    """Whether the run with `output_dir` owns `checkpoint_dir` (both resolved).

    Args:
      checkpoint_dir: the checkpoint directory.
      output_dir: the run's output directory.
      record: the directory's owner record (`read_owner`).
    """
    inside = checkpoint_dir.is_relative_to(output_dir)
    if record is not None:
        if record["output_dir"] == str(output_dir):
            return True
        # Copied or moved with its run dir: the record was written for another path. A record
        # for this very path names a run that wrote here from outside: never take that over.
        return inside and record.get("checkpoint_dir") != str(checkpoint_dir)
    return inside or not _has_subdirs(checkpoint_dir)


def read_owner(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The directory's owner record, or None if absent or unreadable (a warning then)."""
    path = Path(checkpoint_dir) / OWNER_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("Ignoring the unreadable owner record %s (%s).", path, e)
        return None
    if (
        not isinstance(record, Mapping)
        or record.get("format") != OWNER_FORMAT
        or not isinstance(record.get("output_dir"), str)
    ):
        logger.warning("Ignoring the owner record %s: not of format %r.", path, OWNER_FORMAT)
        return None
    return dict(record)


def _resolve(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _has_subdirs(directory: Path) -> bool:
    """Whether `directory` holds any folder: step folders, unfinished saves, anything."""
    try:
        return any(p.is_dir() for p in directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _acquire(directory: Path, output_dir: Path, *, create: bool) -> CheckpointDirLock | None:
    """Creates `directory` if needed and locks its lock file without waiting."""
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Never through a link: a copied run dir's lock file may point at any file.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(
                f"paths.checkpoint_dir={str(directory)!r}: its lock file {path} is a symbolic "
                f"link (to {os.readlink(path)}); the run never writes through one and wrote "
                "nothing there. Remove the link."
            ) from e
        if not create:  # only read from: a read-only copy of checkpoints is fine
            logger.info("Not locking %s (%s): this run writes no checkpoints.", directory, e)
            return None
        check_writable_dir(directory, "paths.checkpoint_dir")  # ConfigError naming the key
        raise ConfigError(
            f"paths.checkpoint_dir={str(directory)!r}: its lock file {path} cannot be opened "
            f"({e.strerror or e}). Make it writable, or set paths.checkpoint_dir to another dir."
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            logger.warning(
                "Cannot lock %s (%s): a second run on this dir would not be detected.", path, e
            )
            return None
        raise CheckpointDirInUseError(
            f"paths.checkpoint_dir={str(directory)!r} is in use by another run "
            f"({_holder(path)}); a checkpoint dir belongs to one run at a time and this run "
            "read and wrote nothing there. Wait for that run to end, or start this one in "
            "another hydra.run.dir."
        ) from e
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
    lock = _HELD[directory] = CheckpointDirLock(directory, fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**holder, "output_dir": str(output_dir)}).encode(), 0)
    except OSError as e:  # a full disk: one line, not a traceback
        lock.release()
        raise ConfigError(
            f"paths.checkpoint_dir={str(directory)!r}: its lock file {path} cannot be written "
            f"({e.strerror or e}). Free space there, or set paths.checkpoint_dir to another dir."
        ) from e
    return lock


def _holder(path: Path) -> str:
    """Who holds the lock, from the lock file, for messages."""
    try:
        info = json.loads(path.read_text())
        return (
            f"pid {info['pid']} on host {info['host']} since {info['since']}, "
            f"output dir {info['output_dir']}"
        )
    except (OSError, ValueError, KeyError, TypeError):
        return f"holder unknown: {path} not written yet or unreadable"


def _write_owner(directory: Path, output_dir: Path) -> None:
    """Writes the owner record atomically (readers see the old or the new one)."""
    record = {
        "format": OWNER_FORMAT,
        "output_dir": str(output_dir),
        "checkpoint_dir": str(directory),
        "host": socket.gethostname(),
        "updated": _now(),
    }
    try:  # never through a link planted in a copied run dir
        write_file(
            directory / OWNER_FILE,
            json.dumps(record, indent=1) + "\n",
            tmp_name=f".{OWNER_FILE}.tmp-{os.getpid()}",
        )
    except OSError as e:
        raise ConfigError(
            f"paths.checkpoint_dir={str(directory)!r}: its owner record {OWNER_FILE} cannot be "
            f"written ({e.strerror or e}). Free space there, or set paths.checkpoint_dir to "
            "another dir."
        ) from e
    logger.info("Checkpoint dir %s is owned by the run in %s.", directory, output_dir)
