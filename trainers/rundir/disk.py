"""Room and write access on the disk of a run's dirs, checked before anything is written."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from xshard.errors import ConfigError

#: Free bytes the output dir needs before Hydra writes there: its config dump (``.hydra/``,
#: three files of a few KiB), the first lines of the log file, ``result.json``.
OUTPUT_DIR_MIN_FREE = 64 * 1024


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


def check_free_space(
    path: str | os.PathLike, needed: int, key: str, *, what: str, reclaimable: int = 0
) -> None:
    """Checks that the filesystem of the directory `path` has `needed` bytes free.

    Args:
      path: an existing directory.
      needed: the bytes the run will write there.
      key: the config key `path` came from, for the error message.
      what: what needs the space, for the error message ("one checkpoint").
      reclaimable: bytes in `path` that the run frees before it writes (counted as free).

    Raises:
      ConfigError: naming `key`, `path`, the bytes needed and the bytes free.
    """
    try:
        free = shutil.disk_usage(path).free + reclaimable
    except OSError as e:
        raise ConfigError(
            f"{key}={str(path)!r}: cannot read its free space ({e.strerror or e})."
        ) from e
    if free < needed:
        raise ConfigError(
            f"{key}={str(path)!r} has too little free space for {what}: needs about "
            f"{needed:,} bytes, {free:,} bytes free. Free space there or set {key} to a "
            "larger disk."
        )


def disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes the files under `path` occupy on disk (allocated blocks; 0 if it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
