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

May import: `trainers.rundir` (user paths), `trainers.config`, `trainers.errors`, `xshard`;
never `trainers.tasks`, which builds on it.

docs/tasks.md ("Data options") shows the code a user writes for each.
"""

from trainers.data.arrays import ArrayData
from trainers.data.source import DataSource, EpochData

__all__ = ["ArrayData", "DataSource", "EpochData"]
