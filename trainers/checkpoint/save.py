"""Orbax checkpoints of the `TrainState`, saved by a trainer `Hook`.

Layout under ``paths.checkpoint_dir`` (Orbax's `CheckpointManager`, one folder per step)::

    checkpoints/
      xshard.lock        the lock of the run using the dir   (trainers.checkpoint.owner)
      xshard-owner.json  the run that owns the dir           (trainers.checkpoint.owner)
      100/
        state/       TrainState(step, params, opt_state[, model_state]), Orbax's PyTree format
        metadata/    JSON: format, step, the run's config, the state's signature and checksums
        data/        with a checkpointable data iterator: its state, a JSON file per process
                     (trainers.checkpoint.data_state)
      200/ ...

`CheckpointHook` saves on every ``checkpoint.every_steps``-th step and at the end of the run
("done", "data_exhausted", "stopped"; never on "error"), asynchronously when
``checkpoint.async_save``. `Trainer.fit` hands a state to the hook only after every hook saw
that step's metrics, so `NonFiniteMonitor` has already stopped a run that went bad; the hook
also checks on device that params and optimizer slots are finite and refuses to write
otherwise (cheap: one small reduction per save). Orbax writes into a temporary folder and
renames it when complete, so a crash or ``kill -9`` during a save leaves the previous
checkpoints valid; the next run's manager removes the unfinished folder. A save that fails to
write (disk full) raises `CheckpointWriteError`, one line naming the directory and the space
a checkpoint needs, whether Orbax raised it at once or from its background thread (then at
the next save or when the hook closes); see `trainers.checkpoint.io`.

The metadata makes a checkpoint checkable before and after its arrays are read: see
`trainers.checkpoint.resume`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from trainers.checkpoint.data_state import DATA_ITEM, data_handler, save_args
from trainers.checkpoint.io import (
    checkpoint_bytes,
    complete_steps,
    free_bytes,
    quiet_io_error_noise,
    write_failure,
)
from trainers.config import CheckpointOptions
from trainers.core.model_state import saved_tree
from trainers.core.trainer import Hook, TrainState
from trainers.exits import CheckpointWriteError, NonFiniteError
from xshard.optim.slots import inner_state

logger = logging.getLogger(__name__)

FORMAT = "xshard.checkpoint/1"
STATE_ITEM = "state"
METADATA_ITEM = "metadata"


# --------------------------------------------------------------------------------------------
# Signature and integrity of a state
# --------------------------------------------------------------------------------------------


def state_signature(state: Any) -> dict[str, list]:
    """``{leaf path: [shape, dtype]}`` of a state (arrays or `jax.ShapeDtypeStruct`s)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in leaves}


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (narrower dtypes widened, 64-bit ones split)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """Position-weighted sum of the words of `x`, mod 2**32: any single changed word shows.

    The flat position is built from per-dimension iotas rather than by flattening `x`, which
    would need a resharding on meshes with explicit axes.
    """
    words = _words(x)
    position, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for dim in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim)
        position, stride = position + iota * jnp.uint32(stride % 2**32), stride * words.shape[dim]
    return jnp.sum(words * (position * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


def _finite(tree: Any) -> jax.Array:
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


@jax.jit
def _integrity(state: TrainState) -> tuple[jax.Array, list[jax.Array]]:
    try:
        slots = inner_state(state.opt_state)
    except ValueError:  # not a cross_shard optimizer
        slots = state.opt_state
    # The cross-shard statistics of a skipped step are NaN by design: only params and slots.
    return _finite((state.params, slots)), [_checksum(x) for x in jax.tree.leaves(state)]


def integrity(state: TrainState) -> tuple[bool, dict[str, int]]:
    """Whether params and optimizer slots are finite, and a checksum per leaf (on device).

    Integer checksums do not depend on the summation order, so they are equal on any mesh.
    """
    finite, sums = jax.device_get(_integrity(state))
    paths = state_signature(state)
    return bool(finite), {p: int(s) for p, s in zip(paths, sums)}


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def state_handler(*, replica_parallel: bool) -> ocp.PyTreeCheckpointHandler:
    """The handler of the state item: Orbax's PyTree format (what ``StandardSave`` writes, and
    `trainers.checkpoint.resume` restores with ``StandardRestore``), with this run's own type
    handlers.

    Args:
      replica_parallel: whether a replicated array's device-to-host copy is split over its
        replicas (Orbax's default). That spreads the writing over the hosts of a multi-host
        run, but on first use it compiles one ``jit(slice)`` per distinct (shape, slice): about
        4 s of stall at the first asynchronous save of tiny_gpt on one process
        (docs/benchmarks.md). The registry is the manager's own, never Orbax's global one.

    Returns:
      A `ocp.PyTreeCheckpointHandler` for ``ocp.args.PyTreeSave``.
    """
    scalar = type_handlers.ScalarHandler()
    registry = type_handlers.create_type_handler_registry(
        (int, scalar),
        (float, scalar),
        (bytes, scalar),
        (np.number, scalar),
        (np.ndarray, type_handlers.NumpyHandler()),
        (str, type_handlers.StringHandler()),
        (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class CheckpointHook(Hook):
    """Saves the `TrainState` with Orbax: every `every_steps` steps and at the end.

    Create it after the run's state was restored, on a directory this run owns
    (`trainers.checkpoint.owner.claim_checkpoint_dir`): its `CheckpointManager` removes unfinished
    temporary folders and, after each save, old steps beyond `keep`, whoever wrote them. A
    failed write is raised as a one-line `CheckpointWriteError` by `save` or `close`; its
    other reports lose their tracebacks (`quiet_io_error_noise`).

    Args:
      directory: the run's checkpoint directory (``paths.checkpoint_dir``).
      options: the ``checkpoint`` config.
      config: the run's config (`trainers.config.plain.run_config`), stored in each
        checkpoint's metadata.
      data: the run's data iterator if it is checkpointable (``get_state``/``set_state``):
        its state is saved with each step (`trainers.checkpoint.data_state`); None: the
        data's position is the step.
      serial: held around each save's start: Orbax's saves share process-wide state (the
        ids its background writes are signalled by), so the runs of one process that save
        concurrently (a population's trials) take turns; None: no lock.
      saved_order: the state as checkpoints hold it (`trainers.core.trainer.Trainer.row_order`:
        Muon's momentum in row order whatever the stage); None: as it is.
    """

    def __init__(
        self,
        directory: str | Path,
        options: CheckpointOptions,
        config: dict[str, Any],
        data: Any = None,
        serial: AbstractContextManager[Any] | None = None,
        saved_order: Callable[[TrainState], TrainState] | None = None,
    ):
        self.directory = Path(directory)
        self._saved_order = saved_order or (lambda state: state)
        self._serial = serial or contextlib.nullcontext()
        self.options = options
        self.config = config
        self.data = data
        handlers: dict[str, Any] = {} if data is None else {DATA_ITEM: data_handler()}
        replica_parallel = options.replica_parallel
        if replica_parallel is None:
            replica_parallel = jax.process_count() > 1
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=options.keep,
                keep_period=options.keep_period,
                enable_async_checkpointing=options.async_save,
                cleanup_tmp_directories=True,
            ),
            item_handlers={
                STATE_ITEM: state_handler(replica_parallel=replica_parallel),
                METADATA_ITEM: ocp.JsonCheckpointHandler(),
                **handlers,
            },
        )
        self.last_saved: int | None = self.manager.latest_step()
        self._closed = False
        self._pending: int | None = None  # an async save not waited for yet
        self._needed: int | None = None  # bytes of one checkpoint, known at the first save
        self._trained = False  # whether this run trained a step (else "stopped" saves nothing)
        quiet_io_error_noise()

    def prepare(self, state: TrainState) -> None:
        """Compiles the integrity check for `state`'s shapes and shardings now, at start-up.

        Otherwise its first call, inside the first save, compiles it while the step loop
        waits (seconds for tiny_gpt on CPU; docs/benchmarks.md). It runs once on `state`
        (sums over the arrays, no copy), which fills `jax.jit`'s cache for later saves.
        """
        jax.block_until_ready(_integrity(self._saved_order(state)))

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self._trained = True

    def wants_state(self, step: int) -> bool:
        return self.options.every_steps > 0 and step % self.options.every_steps == 0

    def on_state(self, step: int, state: TrainState) -> None:
        # Other hooks' steps (evaluation) deliver the state too; a stop saves in `on_end`.
        if self.wants_state(step):
            self.save(step, state)

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        if reason != "error":
            try:
                if self._trained or reason != "stopped":  # stopped before a step: write nothing
                    self.save(step, state)
            except BaseException:
                self._close_quietly()
                raise
            self.close()
            return
        self._close_quietly()  # let a save of an earlier, good step finish
        done = complete_steps(self.directory)
        if done:
            logger.info("Last complete checkpoint: step %d in %s.", done[-1], self.directory)

    def save(self, step: int, state: TrainState) -> None:
        """Saves `state` as step `step` unless that step is already saved.

        Raises:
          NonFiniteError: if params or optimizer slots are not finite (nothing is written).
          CheckpointWriteError: if this save, or the previous one still running in the
            background, failed to write (disk full); earlier checkpoints are intact.
        """
        if self.last_saved is not None and step <= self.last_saved:
            return
        state = self._saved_order(state)
        finite, checksums = integrity(state)
        if not finite:
            kept = "none yet" if self.last_saved is None else f"step {self.last_saved}, kept"
            raise NonFiniteError(
                f"Params or optimizer state are not finite at step {step}: no checkpoint is "
                f"written (last checkpoint: {kept})."
            )
        if self._needed is None:
            self._needed = checkpoint_bytes(state)
        with self._write_errors(self._pending):  # the previous save's errors name its step
            self._pending = None
            self.manager.wait_until_finished()
        metadata = {
            "format": FORMAT,
            "step": step,
            "signature": state_signature(state),
            "checksums": checksums,
            "config": self.config,
        }
        items = {
            STATE_ITEM: ocp.args.PyTreeSave(saved_tree(state)),
            METADATA_ITEM: ocp.args.JsonSave(metadata),
        }
        if self.data is not None:  # its position now: after this step's batch, before the next
            items[DATA_ITEM] = save_args(self.data)
        with self._write_errors(step), self._serial:
            self.manager.save(
                step,
                args=ocp.args.Composite(**items),
                force=True,  # this hook decides the steps (wants_state, end of run)
            )
        self._pending = step if self.options.async_save else None
        self.last_saved = step
        logger.info(
            "Checkpoint step %d -> %s%s",
            step,
            self.directory / str(step),
            " (writing in the background)" if self.options.async_save else "",
        )

    def close(self) -> None:
        """Waits for pending saves and closes the manager (idempotent).

        Raises:
          CheckpointWriteError: if the save still running in the background failed to write.
        """
        if self._closed:
            return
        self._closed = True
        with self._write_errors(self._pending):
            self._pending = None
            self.manager.wait_until_finished()
        self.manager.close()

    def _close_quietly(self) -> None:
        """`close`, logging its error in one line: the run is failing already, never mask that."""
        try:
            self.close()
        except Exception as e:  # never mask the run's own error
            logger.error("Waiting for the last checkpoint save failed: %s", _one_line(e))

    @contextlib.contextmanager
    def _write_errors(self, step: int | None) -> Iterator[None]:
        """Turns a failed write of step `step` into a one-line `CheckpointWriteError`."""
        try:
            yield
        except Exception as e:
            reason = write_failure(e)
            if reason is None:
                raise
            raise CheckpointWriteError(self._write_error_message(step, reason)) from e

    def _write_error_message(self, step: int | None, reason: str) -> str:
        done = complete_steps(self.directory)
        needed = f"about {self._needed:,} bytes" if self._needed else "more space"
        free = free_bytes(self.directory)
        kept = (
            f"earlier checkpoints are intact (latest complete: step {done[-1]}); free space "
            "and rerun the same command to resume from it"
            if done
            else "no checkpoint was written yet; free space and rerun the same command"
        )
        return (
            f"Writing checkpoint step {step if step is not None else '?'} to {self.directory} "
            f"failed: {reason}. One checkpoint needs {needed}, "
            f"{'?' if free is None else f'{free:,}'} bytes are free there: {kept} (the "
            "unfinished save is removed then)."
        )


def _one_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}"
