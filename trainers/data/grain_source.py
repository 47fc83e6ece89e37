"""`GrainData`: a Grain `MapDataset` (or any random-access source) as a task's data.

    import grain
    from trainers.data.grain_source import GrainData

    source = grain.MapDataset.source(my_random_access_source).map(parse)   # dicts of arrays
    data = GrainData(source, shuffle=True, num_epochs=None)
    # in the task: def batches(self, global_batch_size, **kw): return data.batches(...)

The pipeline is Grain's own: ``dataset.shuffle(shuffle_seed(seed)).repeat(num_epochs)``
(Grain reshuffles each epoch, and random maps see a new index each epoch), read by
index: the global batch of step ``k`` is elements ``[e * n + j * B, e * n + (j + 1) * B)``
of it, with ``e, j = divmod(k, n // B)``, and each process reads only its slice of that
range, batched with Grain's ``.batch``. A `MapDataset`'s iterator state is just such an
index; here it is a pure function of the step, so the step in the checkpoint is the data's
position and a resumed run reads exactly the batches an uninterrupted one would
(`trainers.data.source.EpochData`). Grain is imported only when a `GrainData` is made
(``pip install 'xshard[grain]'``).

Give the dataset before any ``.shuffle``, ``.repeat`` or ``.batch``: `GrainData` adds them.
Element-wise ``.map`` and ``.random_map`` are fine; ``.filter`` is not (Grain cannot batch
a filtered `MapDataset` by position; `GrainData` reports it when made).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from trainers.data.batch import Batch
from trainers.data.source import EpochData


def import_grain() -> Any:
    """The `grain` module, or a one-line error saying how to install it."""
    try:
        import grain
    except ImportError as e:
        raise ImportError(
            "GrainData needs Grain: pip install 'xshard[grain]' (or pip install grain)."
        ) from e
    return grain


class GrainData(EpochData):
    """A Grain `MapDataset` of per-example dicts, shuffled and batched per (seed, epoch).

    Args:
      dataset: a ``grain.MapDataset`` of examples, or anything with ``__len__`` and
        ``__getitem__`` (a Grain random-access data source), wrapped with
        ``grain.MapDataset.source``. Each element is a dict of arrays (batch key -> value).
      shuffle: shuffle with Grain (``MapDataset.shuffle(seed)``), a new order each epoch;
        False: the dataset's order.
      num_epochs: epochs before the data ends (the run ends cleanly); None: endless.
      name: what the data is, for error messages.

    Raises:
      ImportError: if Grain is not installed.
      ValueError: for an empty or infinite dataset.
      TypeError: for a dataset that is not random-access, or elements that are not dicts.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        name: str = "the Grain dataset",
    ):
        grain = import_grain()
        if not isinstance(dataset, grain.MapDataset):
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise TypeError(
                    f"{name}: expected a grain.MapDataset or a random-access source (with "
                    f"__len__ and __getitem__), got {type(dataset).__name__}."
                )
            dataset = grain.MapDataset.source(dataset)
        length = len(dataset)
        if length >= sys.maxsize:
            raise ValueError(
                f"{name} is infinite (repeated?): give it before .repeat(); GrainData makes "
                "the epochs (num_epochs)."
            )
        super().__init__(length, shuffle=shuffle, num_epochs=num_epochs, name=name)
        first = dataset[0]
        if first is None:
            raise ValueError(f"{name}: element 0 is missing (a .filter? filter before GrainData).")
        if not isinstance(first, Mapping):
            raise TypeError(
                f"{name}: elements must be dicts of arrays (batch key -> value), element 0 "
                f"is a {type(first).__name__}."
            )
        self.dataset = dataset
        self._pipelines: dict[int, Any] = {}
        try:  # Grain refuses some pipelines only when batched (e.g. a batch after a filter)
            self.read(0, 0, 0, 1)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    def pipeline(self, seed: int) -> Any:
        """``dataset.shuffle(seed).repeat(num_epochs)`` (without the shuffle if not shuffling).

        Element ``e * num_examples + i`` is position ``i`` of epoch ``e``.
        """
        if seed not in self._pipelines:
            ds = self.dataset.shuffle(seed=shuffle_seed(seed)) if self.shuffle else self.dataset
            self._pipelines[seed] = ds.repeat(self.num_epochs)
        return self._pipelines[seed]

    def read(self, seed: int, epoch: int, start: int, stop: int) -> Batch:
        """Positions ``[start, stop)`` of epoch `epoch`, batched by Grain's ``.batch``."""
        offset = epoch * self.num_examples
        rows = stop - start
        batch = self.pipeline(seed)[offset + start : offset + stop].batch(rows)[0]
        sizes = {np.shape(v)[0] if np.ndim(v) else None for v in batch.values()}
        if sizes != {rows}:
            raise ValueError(
                f"{self.name}: positions [{start}, {stop}) of epoch {epoch} gave a batch of "
                f"{sizes} rows, not {rows} (a .filter in the dataset? filter before GrainData)."
            )
        return {k: np.asarray(v) for k, v in batch.items()}


def shuffle_seed(seed: int) -> int:
    """Grain's shuffle seed for the run's `seed`: a hash of it, not the seed itself.

    Grain shuffles epoch e from ``seed + e``, so with the run's seed as is, run seed 0's
    second epoch would be run seed 1's first. A hashed seed keeps the runs of a seed sweep
    on unrelated orders.
    """
    return int(np.random.SeedSequence([seed, 0x67726169]).generate_state(1, np.uint32)[0] >> 1)
