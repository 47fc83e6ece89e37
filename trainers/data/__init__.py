"""Data for tasks: the `DataSource` interface, epoch-based datasets and file loading.

- `trainers.data.source`: `DataSource` (the `batches` half of the task contract) and
  `EpochData` (finite examples, shuffled per (seed, epoch), split per process, resumable).
- `trainers.data.arrays`: `ArrayData`, NumPy arrays as examples.
- `trainers.data.files`: the ``task.data`` node: a ``.npz``/``.npy``/``.txt`` file as data.
- `trainers.data.file_io`: reading that file without trusting it (no pickle, no FIFO,
  a byte budget for a ``.npz``).
- `trainers.data.grain_source`: `GrainData`, a Grain `MapDataset` (optional extra ``grain``).
- `trainers.data.step_indexed`: data whose batch at step k is a pure function of (seed, k).
- `trainers.data.batch`: `Batch`, what a batch is.

May import: `trainers.rundir` (user paths), `trainers.config`, `trainers.exits`, `xshard`;
never `trainers.tasks`, which builds on it.

docs/tasks.md ("Data options") shows the code a user writes for each.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it, imported on first use (a task needs `Batch`
#: without the sources).
_EXPORTS = {
    "ArrayData": "trainers.data.arrays",
    "DataSource": "trainers.data.source",
    "EpochData": "trainers.data.source",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainers.data' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainers.data.arrays import ArrayData as ArrayData
    from trainers.data.source import DataSource as DataSource
    from trainers.data.source import EpochData as EpochData
