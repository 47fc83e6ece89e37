"""Resuming from an Orbax checkpoint written by `trainers.checkpoint.save.CheckpointHook`.

`find_resume_source` picks the run's own latest checkpoint (a rerun in the same output dir
resumes) or else ``trainer.resume_from``; `trainers.checkpoint.owner` has made sure before that the
run owns its checkpoint dir. A ``trainer.resume_from`` source is only read, never locked,
modified or pruned. `restore_checkpoint` then:

1. reads the step's JSON metadata (unreadable, or valid JSON that is not this format's
   metadata: corrupted) and checks it against the current run
   (`trainers.checkpoint.compat.check_compatible`): the state's tree structure, shapes and
   dtypes, and the task and optimizer ``_target_``, must match, else `CheckpointError` naming
   what differs; other config changes are logged;
2. restores the arrays straight into the shardings of the current run's state, so that a
   checkpoint saved on one mesh restores onto another (`ocp.args.StandardRestore`); one saved
   before the optimizer's statistics were packed restores in its own layout and is packed
   (`trainers.checkpoint.unpacked`);
3. verifies the arrays against the checksums saved with them: Orbax detects truncated or
   missing files, but loads flipped bytes of raw array data without complaint.

A read that fails is corruption only when it met damaged data
(`trainers.checkpoint.io.read_damage`: a truncated, missing or garbled file); a file the OS
refuses to read is a `CheckpointError` saying so, and any other error is raised as it is,
neither with the advice to fall back. A corrupted checkpoint is an error, or with
``checkpoint.fallback_to_previous=true`` a warning and a restore of the step before (the
corrupted folder is moved to ``checkpoints.corrupt/`` in the run's own dir, never deleted).
Nothing is modified when an error is raised.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainers.checkpoint.compat import check_compatible, check_metadata, listing
from trainers.checkpoint.io import (
    complete_steps,
    quiet_io_error_noise,
    read_damage,
    write_failure,
)
from trainers.checkpoint.save import METADATA_ITEM, STATE_ITEM, integrity, state_signature
from trainers.checkpoint.unpacked import packed_like, saved_unpacked, unpacked_abstract
from trainers.core.model_state import from_saved, saved_tree
from trainers.core.trainer import TrainState
from trainers.exits import CheckpointError, CorruptCheckpointError
from trainers.rundir.user_paths import launch_dir, user_path

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestoreSource:
    """Where to resume from.

    Attributes:
      directory: a checkpoints directory (one folder per step).
      step: the step to restore; None: the latest complete one.
      own: the run's own directory (corrupted steps may be moved aside there).
    """

    directory: Path
    step: int | None = None
    own: bool = False


def find_resume_source(checkpoint_dir: str | Path, resume_from: str | None) -> RestoreSource | None:
    """The run's own checkpoints if it has any, else ``trainer.resume_from``, else None.

    Args:
      checkpoint_dir: the run's checkpoint directory.
      resume_from: a checkpoints directory, one of its step folders, or a run's output
        directory (holding ``checkpoints/``); or None. Relative to the directory of the
        user's command (`trainers.rundir.user_paths.launch_dir`), ``~`` expanded.

    Raises:
      CheckpointError: if `resume_from` holds no complete checkpoint.
    """
    if complete_steps(checkpoint_dir):
        if resume_from:
            logger.info(
                "This run's %s has checkpoints: resuming from them, not from "
                "trainer.resume_from=%s.",
                checkpoint_dir,
                resume_from,
            )
        return RestoreSource(Path(checkpoint_dir), own=True)
    if not resume_from:
        return None
    path = user_path(resume_from, launch_dir())  # where the user typed it, not the run dir
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name.isdigit() and (path / STATE_ITEM).is_dir():
        if int(path.name) in complete_steps(path.parent):
            return RestoreSource(path.parent, int(path.name))
    elif complete_steps(path):
        return RestoreSource(path)
    raise CheckpointError(
        f"trainer.resume_from={resume_from!r} ({path}) holds no complete checkpoint: expected a "
        "checkpoints directory (step folders such as 100/), one step folder, or a run's "
        "output directory."
    )


def restore_checkpoint(
    source: RestoreSource,
    target: TrainState,
    config: dict[str, Any],
    *,
    fallback_to_previous: bool = False,
    action: str = "Resuming from",
) -> TrainState:
    """Restores a checkpoint into the shapes, dtypes and shardings of `target`.

    Args:
      source: where to restore from (`find_resume_source`).
      target: a state of the current run (e.g. freshly initialised); only its structure,
        shapes, dtypes and shardings are used.
      config: the current run's config (`trainers.config.plain.run_config`), compared with
        the checkpoint's.
      fallback_to_previous: if the latest step is corrupted, warn and try the one before. In
        the run's own directory, a corrupted step is moved to ``<directory>.corrupt/``, so
        that the resumed run can save that step again; nothing is deleted.
      action: what the restore is for, in the warning about a changed config.

    Returns:
      The restored state.

    Raises:
      CheckpointError: if the checkpoint does not match the run (naming what differs), or is
        corrupted (and no fallback is allowed or possible). Nothing is modified then, except
        corrupted steps that a fallback already moved aside (the message names them).
    """
    quiet_io_error_noise()  # a corrupted file fails one read of many
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
    )
    directory = user_path(source.directory)  # Orbax reads absolute paths only
    steps = [source.step] if source.step is not None else complete_steps(directory)[::-1]
    moved: list[Path] = []
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        for i, step in enumerate(steps):
            path = directory / str(step)
            try:
                return _restore_step(checkpointer, path, abstract, config, action)
            except CorruptCheckpointError as e:
                previous = steps[i + 1] if i + 1 < len(steps) else None
                if fallback_to_previous and previous is not None:
                    logger.warning(
                        "%s Falling back to step %d (checkpoint.fallback_to_previous).", e, previous
                    )
                    if source.own and jax.process_index() == 0:
                        moved.append(move_aside(path))
                    continue
                if previous is not None:
                    hint = (
                        f"Set checkpoint.fallback_to_previous=true to resume from step "
                        f"{previous} instead."
                    )
                elif source.step is not None:
                    hint = "Choose another step folder in trainer.resume_from."
                else:
                    hint = "There is no earlier checkpoint: move the folder away to start afresh."
                done = (
                    f"Moved aside: {', '.join(map(str, moved))}."
                    if moved
                    else "Nothing was modified."
                )
                raise CheckpointError(f"{e} {hint} {done}") from e
    raise CheckpointError(f"No complete checkpoint in {directory}.")


def _restore_step(
    checkpointer: ocp.Checkpointer, path: Path, abstract: Any, config: dict, action: str
) -> Any:
    """Metadata, compatibility check, arrays, checksums: one step folder, in that order."""
    metadata = _read_metadata(checkpointer, path)
    _check_step(path, metadata.get("step"), "its metadata")
    unpacked = saved_unpacked(metadata["signature"])  # saved before issue 38's packing
    target = unpacked_abstract(abstract) if unpacked else abstract
    check_compatible(metadata, state_signature(target), config, where=str(path), action=action)
    try:
        saved = checkpointer.restore(
            path,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(saved_tree(target))}),
        )[STATE_ITEM]
        state = from_saved(saved, target)
    except Exception as e:
        _raise_read_error(
            e, path, f"Checkpoint {path} is corrupted or truncated: {_first_line(e)}."
        )
        raise
    _, checksums = integrity(state)
    saved = metadata.get("checksums", {})
    bad = [p for p, s in checksums.items() if saved.get(p) != s]
    if bad:
        raise CorruptCheckpointError(
            f"Checkpoint {path} is corrupted: the data of {listing(bad)} does not match the "
            "checksums saved with it."
        )
    restored = int(jax.device_get(state.step))
    _check_step(path, restored, "its state")
    if unpacked:
        state = packed_like(state, abstract)
        logger.info("Packed the optimizer statistics of %s (saved unpacked).", path)
    logger.info("Restored step %d from %s.", restored, path)
    return state


def saved_config(source: RestoreSource, step: int) -> Mapping[str, Any]:
    """The run config saved with `step` of `source` (`restore_checkpoint` restored it): what
    the run that wrote it resolved at start-up, e.g. its ``trainer.grad_impl``.

    Raises:
      CheckpointError: if its metadata cannot be read.
    """
    path = user_path(source.directory) / str(step)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        return _read_metadata(checkpointer, path)["config"]


def _read_metadata(checkpointer: ocp.Checkpointer, path: Path) -> Mapping[str, Any]:
    """A step's JSON metadata, checked to be xshard's (`_check_metadata`)."""
    try:
        metadata = checkpointer.restore(
            path, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()})
        )[METADATA_ITEM]
    except Exception as e:
        _raise_read_error(
            e, path, f"Checkpoint {path}: its metadata cannot be read ({_first_line(e)})."
        )
        raise
    check_metadata(metadata, path)
    return metadata


def _raise_read_error(error: Exception, path: Path, corrupted: str) -> None:
    """Raises what a failed read of checkpoint `path` is: `CorruptCheckpointError` with the
    message `corrupted` for damaged data (`trainers.checkpoint.io.read_damage`), a plain
    `CheckpointError` for a file the OS refuses to read (the data may be fine: no fallback is
    offered); returns for any other error, which the caller re-raises as it is."""
    if read_damage(error):
        raise CorruptCheckpointError(corrupted) from error
    failure = write_failure(error)
    if failure is not None:
        raise CheckpointError(
            f"Checkpoint {path} cannot be read: {failure} ({_first_line(error)}). It is not "
            "corrupted as far as can be told: fix the access and run again. Nothing was modified."
        ) from error


def _check_step(path: Path, step: Any, where: str) -> None:
    """Refuses a step folder whose name is not the step it holds.

    A folder copied or renamed in a copied run dir (``checkpoints/99999999999`` holding step
    10) would be taken for the latest checkpoint: the run would resume from its step and its
    checkpoint manager would then prune the steps the run saves, as older than the forged one.
    A `CheckpointError`, not a corrupted checkpoint: no fallback moves it, nothing is written.
    A metadata without a step (`where` "its metadata") is checked on the restored state.
    """
    if step is None and where == "its metadata":
        return
    if isinstance(step, int) and not isinstance(step, bool) and str(step) == path.name:
        return
    raise CheckpointError(
        f"Checkpoint folder {path} holds step {step!r:.40} ({where} says so), not step "
        f"{path.name}: a step folder's name must be its step (a copied or renamed folder would "
        "be resumed from as the latest one, and the newer steps pruned). Nothing was restored, "
        f"pruned or written. Move the folder away, or rename it to the step it holds."
    )


def move_aside(path: Path, folder: str = "corrupt", why: str = "corrupted") -> Path:
    """Moves a step folder to ``<checkpoints>.<folder>/<step>`` (nothing is deleted); returns
    where. `why`: what the step is, in the log line and the error."""
    dest_dir = path.parent.with_name(f"{path.parent.name}.{folder}")
    if dest_dir.is_symlink():  # the start-up check refuses links out of the run dir already
        raise CheckpointError(
            f"Checkpoint {path} is {why}, and {dest_dir} is a symbolic link (to "
            f"{dest_dir.readlink()}): the step is not moved through it. Remove the link."
        )
    dest = dest_dir / path.name
    n = 1
    while dest.exists() or dest.is_symlink():
        dest, n = dest_dir / f"{path.name}-{n}", n + 1
    dest_dir.mkdir(parents=True, exist_ok=True)
    shutil.move(path, dest)
    logger.warning("Moved checkpoint %s (%s) to %s.", path, why, dest)
    return dest


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:300]}{'...' if len(line) > 300 else ''}"


def with_saved_replica_shapes(
    target: TrainState, step_dir: Path, replica_axes: tuple[str, ...]
) -> Any:
    """`target` (abstract) with the saved shapes of its per-replica leaves: those whose first
    dimension is sharded over one of `replica_axes` (a periodic axis's replicas, an axis
    rule's residual rows, whose sizes depend on the axis's size in the run that saved them).

    For a state built on a smaller mesh than the run's (`trainers.load` on one device): every
    other leaf keeps its shape, so a checkpoint of another model still fails its restore.

    Raises:
      CorruptCheckpointError: if the step's metadata cannot be read or is not xshard's.
    """
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        metadata = _read_metadata(checkpointer, step_dir)
    signature = metadata["signature"]

    def shape(path: Any, x: Any) -> Any:
        spec = tuple(getattr(x.sharding, "spec", ()))
        first = spec[0] if spec else None
        names = (first,) if isinstance(first, str) else tuple(first or ())
        saved = signature.get(jax.tree_util.keystr(path))
        if saved is None or not set(names) & set(replica_axes):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(tuple(saved[0]), x.dtype, sharding=x.sharding)

    return jax.tree_util.tree_map_with_path(shape, target)
