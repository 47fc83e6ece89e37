"""What a part of the run writes, declared once, and the files it appends to, opened safely.

Every writer of the run dir that is not the run's own bookkeeping (the loggers: CSV, W&B,
MLflow's file store) declares its `Outputs`: the start-up check (`trainers.rundir.links`)
reads them, so a link planted at any of those paths in a copied run dir is refused before a
byte is written, and the writer then writes them by the same rule:

- **appended** files (``metrics.csv``, the log file) are opened with `open_appended`: never
  through a symbolic link (``O_NOFOLLOW``) and never when the file has another name (a hard
  link, ``st_nlink > 1``: ``O_NOFOLLOW`` does not see those, and appending to one writes to
  its other name, which may lie anywhere on the same filesystem);
- **replaced** files (``metrics.config.yaml``, ``metrics.hparams.json``) are written with
  `trainers.rundir.links.write_file`: a new file renamed over the old one, so a link in their
  place is replaced and its target left alone;
- **folders** others write in (W&B's ``wandb/``) are checked as ``tb/`` and ``checkpoints/``
  are: no link out of the run dir on the way there nor anywhere inside them.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from typing import NamedTuple

from trainers.exits import LinkOutOfRunDirError

#: How deep the start-up check looks into a folder by default: everything in it.
ALL_LEVELS = 64


class Folder(NamedTuple):
    """A folder others write files in.

    Attributes:
      path: the folder.
      key: the config key it comes from, for the error message.
      depth: how many levels of its entries are written to, and so checked (1: its own
        entries). Less than `ALL_LEVELS` where the writer only ever adds new folders below
        that level and links of its own lead out of them (W&B's ``logs/debug-core.log``).
    """

    path: str
    key: str
    depth: int = ALL_LEVELS


class Outputs(NamedTuple):
    """The paths a part of the run writes, by how it writes them (module docstring).

    Attributes:
      appended: files appended to (a rerun adds to them).
      replaced: files written anew each run.
      folders: folders others write files in.
    """

    appended: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    folders: tuple[Folder, ...] = ()


def merged(outputs: Iterable[Outputs]) -> Outputs:
    """All of `outputs` as one `Outputs`."""
    parts = list(outputs)
    return Outputs(
        appended=tuple(p for o in parts for p in o.appended),
        replaced=tuple(p for o in parts for p in o.replaced),
        folders=tuple(f for o in parts for f in o.folders),
    )


def hard_link_error(path: str | os.PathLike[str], links: int) -> LinkOutOfRunDirError:
    """The one-line refusal of appending to `path`, a file with `links` names."""
    return LinkOutOfRunDirError(
        f"{path} is a hard link: the file has {links} names, and the others may lie outside "
        "the run dir. A run dir copied or moved from elsewhere may hold such a file, so the "
        "run refuses to start and appends nothing to it. Remove that name, or replace it by "
        "a copy of the file."
    )


def symbolic_link_error(path: str | os.PathLike[str]) -> LinkOutOfRunDirError:
    """The one-line refusal of appending through the symbolic link `path`."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return LinkOutOfRunDirError(
        f"{path} is a symbolic link (to {target}): the run never appends to a file through a "
        "link, so it refuses to start. Remove the link."
    )


def check_appended(path: str | os.PathLike[str]) -> None:
    """Refuses a file the run appends to if it is a link of either kind (a missing file is
    fine: the run creates it).

    Raises:
      LinkOutOfRunDirError: naming `path` (and, for a symbolic link, its target).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if os.path.islink(path):
        raise symbolic_link_error(path)
    if st.st_nlink > 1:
        raise hard_link_error(path, st.st_nlink)


def open_appended(path: str | os.PathLike[str], *, truncate: bool = False) -> int:
    """Opens (creating it) the file `path` to append to it, never through a link.

    The check of its link count is made on the open file, before anything is written or
    truncated: a file replaced by a link between a check and the open cannot slip through.

    Args:
      path: the file.
      truncate: empty it first (``mode="w"``), once it is known to be no link.

    Returns:
      The file descriptor (``O_WRONLY | O_APPEND``); the caller closes it.

    Raises:
      LinkOutOfRunDirError: `path` is a symbolic link, or a file with several names.
      OSError: it cannot be opened (no space, no access).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise symbolic_link_error(path) from e
        raise
    try:
        links = os.fstat(fd).st_nlink
        if links > 1:
            raise hard_link_error(path, links)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
