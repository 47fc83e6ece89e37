"""Disk space and write failures of checkpoints: what a save needs, and why one failed.

A full disk must not surface as a traceback from Orbax's background thread, nor be found
only at the first save: `check_checkpoint_space` runs at start-up (the run fails early if
one checkpoint does not fit), and `write_failure` recognises a failed write among the errors a
save raises (an `OSError`, or tensorstore's ``ValueError`` carrying ``os_error_code``), so
that `CheckpointHook` can report it in one line. `read_damage` tells a restore that met damaged
data (a truncated, deleted or garbled file of the checkpoint) from one that failed for any other
reason (a file it may not read, a bug), which is not corruption and must not be reported as
such. `quiet_io_error_noise` keeps the same
error's other reports (Orbax's and asyncio's logs, tensorstore's late callbacks) from
printing tracebacks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainers.rundir.disk import check_free_space, disk_bytes

#: Orbax's files besides the array data: metadata and sharding per array, and a few small
#: files per checkpoint (each at least one filesystem block). Measured on `task=mlp` (27
#: arrays, 66 KB of data): 200-220 KB per checkpoint on tmpfs.
BYTES_PER_ARRAY = 1024
BYTES_PER_CHECKPOINT = 128 * 1024

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
#: TensorStore's status codes of a read that met damaged data: a file cut short (OUT_OF_RANGE),
#: bytes that do not decode or fail their check (DATA_LOSS), a file of the checkpoint missing
#: (NOT_FOUND, FAILED_PRECONDITION for a missing OCDBT process folder).
DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")
_DAMAGE_STATUS = re.compile(r"\b(?:" + "|".join(DAMAGE_CODES) + r"): ")
#: Orbax's own words for a checkpoint whose files disagree: an item folder missing, or an
#: array tree that is not the one its metadata declares (a deleted or garbled ``_METADATA``).
_DAMAGE_TEXT = ("was not found in the checkpoint", "pytree structure error")

logger = logging.getLogger(__name__)


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
    """Why a save failed, if it failed to write: the OS error's text, else None (a failed
    read too: a restore that may not read a file).

    Looks through the exception's causes: Orbax re-raises the errors of its background
    threads, and tensorstore reports OS errors as ``ValueError("RESOURCE_EXHAUSTED: ...
    [os_error_code='28']")``.

    Args:
      error: an exception raised by a save.

    Returns:
      E.g. "No space left on device"; None for an error that is not a failed write.
    """
    for e in _causes(error):
        if isinstance(e, OSError):
            return e.strerror or f"{type(e).__name__}: {e}"
        match = _OS_ERROR_CODE.search(str(e))
        if match:
            return os.strerror(int(match.group(1)))
    return None


def read_damage(error: BaseException) -> bool:
    """Whether a failed restore met damaged data, looking through the exception's causes.

    Damaged: a TensorStore status of `DAMAGE_CODES`, a JSON file that does not parse, a file
    or item folder of the checkpoint missing, an array tree that disagrees with its metadata.
    Not damaged (False): every other error, among them a file that may not be read
    (``PERMISSION_DENIED``, `PermissionError`) and errors of the caller (Orbax's "Checkpoint
    path should be absolute").
    """
    for e in _causes(error):
        if isinstance(e, PermissionError) or "PERMISSION_DENIED" in str(e):
            return False
        if isinstance(e, (json.JSONDecodeError, FileNotFoundError)):
            return True
        text = str(e)
        if _DAMAGE_STATUS.search(text) or any(t in text for t in _DAMAGE_TEXT):
            return True
    return False


def _causes(error: BaseException) -> list[BaseException]:
    """`error` and its causes (``__cause__``, else ``__context__``), each once."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def free_bytes(directory: str | Path) -> int | None:
    """Bytes free on the filesystem of `directory`, or None if it cannot be read."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


class IOErrorsInOneLine(logging.Filter):
    """Logs a failed write or read in one line: drops the traceback, keeps the message.

    Orbax logs the error of a failed background save with its traceback (through absl) up to
    four times, and asyncio logs its unretrieved tasks ("Task exception was never
    retrieved"); the run raises the same error in the main thread in one line. Records of
    other errors keep their tracebacks.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and write_failure(error) is not None:
            first = (str(error).strip().splitlines() or [""])[0]
            if first and first not in record.getMessage():
                record.msg = f"{record.getMessage()} ({type(error).__name__}: {first})"
                record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def _is_closed_loop_callback(unraisable: Any) -> bool:
    """An asyncio ``call_soon_threadsafe`` on a closed loop, called from outside Python."""
    error, tb = unraisable.exc_value, unraisable.exc_traceback
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed" or tb is None:
        return False
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return frames[0].co_name == "call_soon_threadsafe" and all(
        Path(code.co_filename).parent.name == "asyncio" for code in frames
    )


def quiet_io_error_noise() -> None:
    """Keeps the aftermath of a failed checkpoint write or read off the console.

    When one array of an Orbax save or restore fails (disk full, truncated file), the run
    raises that error in one line; meanwhile:

    - Orbax (absl) and asyncio log it with its traceback: `IOErrorsInOneLine` on those
      loggers keeps the message and drops the traceback;
    - Orbax's asyncio loop ends while tensorstore still completes the other operations; their
      callbacks (``loop.call_soon_threadsafe``) raise ``RuntimeError: Event loop is closed``
      from C++, which Python reports through `sys.unraisablehook` with a traceback, at any
      later moment. Exactly those are dropped (logged at debug level); every other
      unraisable exception goes to the previous hook.

    Installed once per process, for good: the noise can come after the save or restore
    returned.
    """
    if isinstance(sys.unraisablehook, QuietUnraisableHook):
        return
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(IOErrorsInOneLine())
    sys.unraisablehook = QuietUnraisableHook(sys.unraisablehook)


class QuietUnraisableHook:
    """`sys.unraisablehook` that drops the callbacks into a closed asyncio loop that follow a
    failed checkpoint write or read (`quiet_io_error_noise`) and hands every other unraisable
    exception to the hook it replaced.

    Args:
      previous: the hook it replaced.
    """

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if _is_closed_loop_callback(unraisable):
            logger.debug("Dropped a callback into a closed asyncio loop (after an I/O error).")
            return
        self.previous(unraisable)
