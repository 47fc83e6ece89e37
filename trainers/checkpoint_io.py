"""Disk space and write failures of checkpoints: what a save needs, and why one failed.

A full disk must not surface as a traceback from Orbax's background thread, nor be found
only at the first save: `check_checkpoint_space` runs at start-up (the run fails early if
one checkpoint does not fit), and `write_failure` recognises a failed write among the errors a
save raises (an `OSError`, or tensorstore's ``ValueError`` carrying ``os_error_code``), so
that `CheckpointHook` can report it in one line.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainers.preflight import check_free_space, disk_bytes

#: Orbax's files besides the array data: metadata and sharding per array, and a few small
#: files per checkpoint (each at least one filesystem block). Measured on `task=mlp` (27
#: arrays, 66 KB of data): 200-220 KB per checkpoint on tmpfs.
BYTES_PER_ARRAY = 1024
BYTES_PER_CHECKPOINT = 128 * 1024

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def complete_steps(directory: str | Path) -> list[int]:
    """The steps of `directory` whose save completed (unfinished temporary folders excluded)."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


def unfinished_saves(directory: str | Path) -> list[Path]:
    """The temporary folders of saves that did not complete (``<step>.orbax-checkpoint-tmp``).

    The next `CheckpointManager` of the directory removes them.
    """
    if not Path(directory).is_dir():
        return []
    return [Path(p.get()) for p in ocp.path.step.all_temporary_paths(directory)]


def checkpoint_bytes(state: Any) -> int:
    """About how many bytes one checkpoint of `state` takes on disk.

    Args:
      state: a pytree of arrays (or of `jax.ShapeDtypeStruct`s with ``nbytes``).

    Returns:
      The arrays' bytes plus 5%, plus Orbax's metadata (`BYTES_PER_ARRAY` per array and
      `BYTES_PER_CHECKPOINT`).
    """
    leaves = jax.tree.leaves(state)
    data = sum(int(x.nbytes) for x in leaves)
    return data + data // 20 + BYTES_PER_ARRAY * len(leaves) + BYTES_PER_CHECKPOINT


def check_checkpoint_space(directory: str | Path, state: Any) -> int:
    """Fails early when the free space of `directory` cannot hold one checkpoint of `state`.

    Unfinished saves of an earlier run count as free: the run's `CheckpointManager` removes
    them before it saves.

    Args:
      directory: the run's checkpoint directory (``paths.checkpoint_dir``), existing.
      state: the run's state.

    Returns:
      The bytes one checkpoint needs (`checkpoint_bytes`).

    Raises:
      ConfigError: naming ``paths.checkpoint_dir``, the bytes needed and the bytes free.
    """
    needed = checkpoint_bytes(state)
    reclaimable = sum(disk_bytes(p) for p in unfinished_saves(directory))
    check_free_space(
        directory,
        needed,
        "paths.checkpoint_dir",
        what="one checkpoint",
        reclaimable=reclaimable,
    )
    return needed


def write_failure(error: BaseException) -> str | None:
    """Why a save failed, if it failed to write: the OS error's text, else None.

    Looks through the exception's causes: Orbax re-raises the errors of its background
    threads, and tensorstore reports OS errors as ``ValueError("RESOURCE_EXHAUSTED: ...
    [os_error_code='28']")``.

    Args:
      error: an exception raised by a save.

    Returns:
      E.g. "No space left on device"; None for an error that is not a failed write.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e.strerror or f"{type(e).__name__}: {e}"
        match = _OS_ERROR_CODE.search(str(e))
        if match:
            return os.strerror(int(match.group(1)))
        e = e.__cause__ or e.__context__
    return None


def free_bytes(directory: str | Path) -> int | None:
    """Bytes free on the filesystem of `directory`, or None if it cannot be read."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


class DropTracebacks(logging.Filter):
    """Logs Orbax's errors in one line: drops the traceback, keeps the message.

    Orbax logs the error of a failed background save with its traceback (through absl) up to
    four times; `CheckpointHook` raises the same error in the main thread, in one line if it
    is a failed write and with its traceback otherwise, so nothing is lost.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            first = (str(error).strip().splitlines() or [""])[0]
            if first and first not in record.getMessage():
                record.msg = f"{record.getMessage()} ({type(error).__name__}: {first})"
                record.args = None
            record.exc_info = None
            record.exc_text = None
        return True
