"""No write leaves the run dir through a symbolic link planted in it.

A run dir copied or moved from elsewhere is not trusted (copying one is a documented workflow,
docs/reliability.md): a link planted in it, ``checkpoints/xshard.lock -> ~/.bashrc`` or
``tb/<run name> -> /elsewhere``, would redirect the run's writes outside it. So:

- the files the run writes itself are never written through a link: the files it appends
  to, the log file (`trainers.rundir.log_file.RunLogFile`) and the CSV logger's
  ``metrics.csv`` (`trainers.rundir.outputs.open_appended`: ``O_NOFOLLOW``, and no file with
  another name, a hard link), the checkpoint dir's lock file (`trainers.checkpoint.owner`,
  ``O_NOFOLLOW``), ``result.json``, the owner record, the config dump of a multi-process run,
  the sweep table and the loggers' config and hparams files (`write_file`: a new file next to
  it, renamed over it, so a link in its place is replaced and its target left alone);
- directories cannot be opened that way, and others write in them (Hydra its config dump,
  Orbax the step folders, TensorBoard the event files, W&B its ``wandb/``). Before anything is
  written there, the run refuses to start (exit 2, one line naming the link,
  `LinkOutOfRunDirError`) if one of those directories, or a path the run writes in them,
  resolves outside the run dir, or a file it appends to is a link of either kind:
  `trainers.app.preflight.RunDirLinksCheck`, a Hydra callback, before Hydra writes its config
  dump and opens the log file; `check_run_dirs` in the run, before it creates, locks or
  writes anything else (the loggers declare what they write: `trainers.rundir.outputs.Outputs`).

Paths set outside the run dir on purpose (``paths.checkpoint_dir=/data/ckpt``) are the user's
choice and are not checked; a link that stays inside the run dir is harmless and allowed,
except at a file the run appends to, which is never written through a link.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from trainers.exits import LinkOutOfRunDirError
from trainers.rundir.outputs import Outputs, check_appended

#: The files of Hydra's config dump (``<output dir>/<hydra.output_subdir>/``).
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
#: A run's outcome (`trainers.app.sweep.write_result`) and its temporary file.
RESULT_FILES = ("result.json", "result.json.tmp")
#: What Hydra writes in a sweep dir before the first job starts.
SWEEP_FILES = ("multirun.yaml",)
#: Folders under a sweep dir the sweep scan does not descend into (the jobs check them).
_NOT_SCANNED = ("checkpoints", "tb")


# --------------------------------------------------------------------------------------------
# Writing a file without following a link
# --------------------------------------------------------------------------------------------


def write_file(path: str | os.PathLike, data: bytes | str, *, tmp_name: str | None = None) -> Path:
    """Writes `data` to `path` atomically, never through a link: readers see the old file or
    the new one; a link at `path` is replaced by the file, its target left unchanged.

    The data goes to a new file next to `path` (``<name>.tmp``, or `tmp_name`), created with
    ``O_EXCL | O_NOFOLLOW`` after removing whatever had that name, then renamed over `path`.
    On any error the temporary file is removed (no empty file is left on a full disk).

    Returns:
      `path` as a `Path`.

    Raises:
      OSError: if it cannot be written (the old file, if any, is unchanged).
    """
    path = Path(path)
    tmp = path.with_name(tmp_name or f"{path.name}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a link there is removed, not followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# --------------------------------------------------------------------------------------------
# Finding links out of the run dir
# --------------------------------------------------------------------------------------------


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def outside_link(
    path: str | os.PathLike, roots: Sequence[str | os.PathLike]
) -> tuple[str, str] | None:
    """The link through which `path` leads out of the root that holds it, if any.

    Args:
      path: a path the run writes (made absolute; links not resolved).
      roots: the run dir (and, in a multirun, the sweep dir). `path` is checked against the
        deepest root that holds it as written; a path in none of them is not checked.

    Returns:
      ``(link, its target)`` for the first link on the way from the root to `path` that leads
      out of the root (resolved), or None if `path` resolves inside it (or is in no root).
    """
    target = os.path.abspath(path)
    held = [os.path.abspath(r) for r in roots if _inside(target, os.path.abspath(r))]
    if not held:
        return None
    root = max(held, key=len)
    real_root = os.path.realpath(root)
    if _inside(os.path.realpath(target), real_root):
        return None
    current = root
    for part in Path(target).relative_to(root).parts:
        current = os.path.join(current, part)
        if os.path.islink(current) and not _inside(os.path.realpath(current), real_root):
            return current, os.readlink(current)
    return target, os.path.realpath(target)  # unreachable unless the tree changes meanwhile


def _entries(directory: str, depth: int) -> Iterator[str]:
    """`directory`'s entries down to `depth` levels (1: its own), without following links."""
    try:
        with os.scandir(directory) as scan:
            found = list(scan)
    except OSError:  # missing, not a directory, unreadable: nothing written there yet
        return
    for entry in found:
        yield entry.path
        if depth > 1 and entry.is_dir(follow_symlinks=False):
            yield from _entries(entry.path, depth - 1)


def _refuse(link: str, target: str, written: str, root: str, key: str | None) -> None:
    via = "" if os.path.abspath(written) == link else f" (the run writes {written} through it)"
    instead = (
        f", or set {key} to a directory outside the run dir if that is where it belongs"
        if key in ("paths.checkpoint_dir", "paths.tb_dir")
        else ""
    )
    raise LinkOutOfRunDirError(
        f"{link} is a symbolic link to {target}, outside the run dir {root}{via}. A run dir "
        "copied or moved from elsewhere may hold such links, so the run refuses to start and "
        f"writes nothing through it. Remove the link{instead}."
    )


def check_run_dir(
    run_dir: str | os.PathLike,
    *,
    hydra_subdir: str | None = ".hydra",
    log_files: Iterable[str | os.PathLike[str]] = (),
    checkpoint_dir: str | os.PathLike | None = None,
    tb_dir: str | os.PathLike | None = None,
    sweep_dir: str | os.PathLike | None = None,
    outputs: Outputs | None = None,
) -> None:
    """Refuses the run if a path it writes in its run dir resolves outside it (module doc).

    Checked, where they lie in `run_dir` (or `sweep_dir`) as configured: the log files, the
    config dump (``<hydra_subdir>/`` and its files), ``result.json``, the checkpoint dir with
    its entries and ``<checkpoint_dir>.corrupt/`` with its entries, the TensorBoard dir with
    everything in it, and the `outputs` of the loggers. A file the run appends to (a log file,
    ``metrics.csv``) may not be a link at all, symbolic or hard: it is never appended to
    through one (`trainers.rundir.outputs.check_appended`).

    Args:
      run_dir: the run's output dir (``paths.output_dir``).
      hydra_subdir: ``hydra.output_subdir`` (None: no config dump).
      log_files: the log files of the run (``train.log``).
      checkpoint_dir: ``paths.checkpoint_dir`` (None: not checked).
      tb_dir: ``paths.tb_dir`` (None: not checked).
      sweep_dir: a multirun's sweep dir: a job's TensorBoard dir lies there.
      outputs: what else the run writes (the loggers' files and folders).

    Raises:
      LinkOutOfRunDirError: naming the first such link, its target and the run dir.
    """
    run_dir = os.path.abspath(run_dir)
    roots = [run_dir] + ([os.path.abspath(sweep_dir)] if sweep_dir is not None else [])

    def check(paths: Iterable[str | os.PathLike], key: str | None = None) -> None:
        for path in paths:
            found = outside_link(path, roots)
            if found is not None:
                holder = max((r for r in roots if _inside(os.path.abspath(path), r)), key=len)
                _refuse(*found, str(path), holder, key)

    written = outputs if outputs is not None else Outputs()
    for appended in [*log_files, *written.appended]:
        check([appended])
        if any(_inside(os.path.abspath(appended), r) for r in roots):
            check_appended(appended)  # never a link at all, of either kind
    check(written.replaced)
    for folder in written.folders:
        check([folder.path], folder.key)
        check(_entries(os.path.abspath(folder.path), folder.depth), folder.key)
    if hydra_subdir is not None:
        dump = os.path.join(run_dir, str(hydra_subdir))
        check([dump, *(os.path.join(dump, f) for f in HYDRA_FILES)], "hydra.output_subdir")
    check(os.path.join(run_dir, f) for f in RESULT_FILES)
    if checkpoint_dir is not None:
        ckpt = os.path.abspath(checkpoint_dir)
        corrupt = ckpt.rstrip(os.sep) + ".corrupt"
        for directory in (ckpt, corrupt):
            check([directory], "paths.checkpoint_dir")
            check(_entries(directory, 1), "paths.checkpoint_dir")
    if tb_dir is not None:
        tb = os.path.abspath(tb_dir)
        check([tb], "paths.tb_dir")
        check(_entries(tb, 64), "paths.tb_dir")


def check_sweep_dir(
    sweep_dir: str | os.PathLike, hydra_subdir: str | None, log_names: Iterable[str]
) -> None:
    """`check_run_dir` for every folder of an existing sweep dir, before Hydra writes a job's
    config dump and log file there (the jobs check their checkpoints and events themselves).

    Raises:
      LinkOutOfRunDirError: naming the first link that leads out of its folder.
    """
    names = list(log_names)
    skip = {*_NOT_SCANNED, *([str(hydra_subdir)] if hydra_subdir is not None else [])}
    top = os.path.abspath(sweep_dir)
    for name in SWEEP_FILES:
        found = outside_link(os.path.join(top, name), [top])
        if found is not None:
            _refuse(*found, os.path.join(top, name), top, None)
    for root, dirs, _ in os.walk(top):  # links are not followed
        check_run_dir(
            root, hydra_subdir=hydra_subdir, log_files=[os.path.join(root, n) for n in names]
        )
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".corrupt")]


# --------------------------------------------------------------------------------------------
# Where the checks run
# --------------------------------------------------------------------------------------------


def check_run_dirs(
    output_dir: str,
    checkpoint_dir: str,
    tb_dir: str,
    *,
    lead: bool,
    outputs: Outputs | None = None,
    hydra_subdir: str | None = None,
    sweep_dir: str | None = None,
) -> None:
    """`check_run_dir` in the run (`trainers.train`), before it creates, locks or writes
    anything: the job's log files and config dump, ``result.json``; on process 0 (the only
    one that writes them) the checkpoint dir, the TensorBoard dir and the loggers' `outputs`
    too.

    Args:
      hydra_subdir: Hydra's ``hydra.output_subdir`` (its config dump), None if none.
      sweep_dir: a multirun's sweep dir, None for a single run
        (`trainers.app.hydra_run.hydra_dirs` reads both).

    Raises:
      LinkOutOfRunDirError: naming the link (one line, exit 2).
    """
    logs = [
        h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)
    ]
    check_run_dir(
        output_dir,
        hydra_subdir=hydra_subdir,
        log_files=logs,
        checkpoint_dir=checkpoint_dir if lead else None,
        tb_dir=tb_dir if lead else None,
        sweep_dir=sweep_dir,
        outputs=outputs if lead else None,
    )
