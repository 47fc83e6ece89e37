"""The data iterator's state in a checkpoint: the ``data`` item, one JSON file per process.

A task whose ``batches`` iterator is checkpointable (``get_state()`` and ``set_state()``, the
protocol of Grain's ``DatasetIterator`` and ``DataLoaderIterator``; `trainers.data.stream`)
reads data whose position is not a function of the step. Its state is saved with each
checkpoint by Grain's own Orbax handler (``grain.checkpoint.CheckpointHandler``): every
process writes ``data/process_<i>-of-<n>.json`` in the step's folder, at the moment the
step is saved (after that step's batch was read, before the next), and the resumed run
restores it into its fresh iterator, so it reads on exactly where the saved run was. A state
that is not Grain's own (any JSON value) travels as JSON text.

A checkpoint of a run with other data has no ``data`` item: the iterator then starts from
the step as the task's ``batches(start_step=...)`` says (`has_data_state`). Resuming needs
the same number of processes: each reads back its own file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The checkpoint item that holds the data iterator's state.
DATA_ITEM = "data"


def is_checkpointable(iterator: Any) -> bool:
    """Whether `iterator` has ``get_state`` and ``set_state`` (Grain's iterator protocol)."""
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class _JsonState:
    """An iterator whose state is any JSON value, as Grain's handler takes it (bytes)."""

    def __init__(self, iterator: Any):
        self.iterator = iterator

    def get_state(self) -> bytes:
        return json.dumps(self.iterator.get_state(), sort_keys=True).encode()

    def set_state(self, state: bytes) -> None:
        self.iterator.set_state(json.loads(state))

    def start_prefetch(self) -> None:
        """Grain's handler calls it after a restore; the iterator prefetches on its own."""


def _item(iterator: Any) -> Any:
    """`iterator` as Grain's handler saves it: a Grain iterator as is, others as JSON."""
    import grain

    if isinstance(iterator, grain.DatasetIterator | grain.DataLoaderIterator):
        return iterator
    return _JsonState(iterator)


def data_handler() -> Any:
    """Grain's Orbax handler of the ``data`` item (Grain is needed for checkpointable data).

    Raises:
      ImportError: if Grain is not installed, saying how to install it.
    """
    try:
        import grain
    except ImportError as e:
        raise ImportError(
            "Saving a data iterator's state in checkpoints needs Grain: "
            "pip install 'xshard[grain]'."
        ) from e
    return grain.checkpoint.CheckpointHandler()


def save_args(iterator: Any) -> Any:
    """The ``data`` item's save args for the manager's ``Composite``."""
    import grain

    return grain.checkpoint.CheckpointSave(_item(iterator))


def has_data_state(step_dir: Path) -> bool:
    """Whether the checkpoint step folder holds a data iterator's state."""
    return (Path(step_dir) / DATA_ITEM).is_dir()


def restore_data_state(step_dir: Path, iterator: Any) -> bool:
    """Restores `iterator` to the position saved in the step folder, if it holds one.

    Args:
      step_dir: the checkpoint's step folder (``checkpoints/<step>``).
      iterator: the run's fresh data iterator (checkpointable).

    Returns:
      Whether a state was restored (False: the checkpoint has none).

    Raises:
      CheckpointError: the saved state cannot be read into the iterator (another number of
        processes, other data).
    """
    import grain
    import orbax.checkpoint as ocp

    from trainers.exits import CheckpointError

    if not has_data_state(step_dir):
        logger.warning(
            "Checkpoint %s has no data iterator state: the data starts from the step.", step_dir
        )
        return False
    handler = ocp.CompositeCheckpointHandler(**{DATA_ITEM: data_handler()})
    try:
        with ocp.Checkpointer(handler) as checkpointer:
            checkpointer.restore(
                Path(step_dir),
                args=ocp.args.Composite(
                    **{DATA_ITEM: grain.checkpoint.CheckpointRestore(_item(iterator))}
                ),
            )
    except Exception as e:  # one line naming the checkpoint
        text = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(
            f"Checkpoint {step_dir}: the data iterator's saved state cannot be restored "
            f"({type(e).__name__}: {text}); resume with the same data and number of processes."
        ) from e
    logger.info("Restored the data iterator's state from %s.", Path(step_dir) / DATA_ITEM)
    return True
