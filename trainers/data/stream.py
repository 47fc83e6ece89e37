"""`StreamData`: a Grain `IterDataset` (a stream with no random access) as a task's data.

    import grain
    from trainers.data.stream import StreamData

    def make_stream(seed, shard_index, shard_count):       # this process's shard of the data
        source = grain.MapDataset.source(my_source)[shard_index::shard_count]
        return source.shuffle(seed).repeat().to_iter_dataset().map(parse)   # dicts of arrays

    data = StreamData(make_stream)          # in the task: return data.batches(...)

Unlike `trainers.data.source.EpochData`, a stream's position is not a function of the step
(packing, interleaving, filtering): it is the iterator's own state. `batches` returns a
`StreamIterator` with Grain's checkpointable-iterator protocol (``get_state()`` /
``set_state()``); the trainer saves that state in every checkpoint, one file per process
(`trainers.checkpoint.data_state`), and restores it on resume, so a run resumed after
``kill -9`` reads exactly the batches an uninterrupted run would. A checkpoint without a saved
data state (from a run on other data) resumes by skipping ``start_step`` batches.

Each process reads its own shard: a factory is called with ``(seed, shard_index,
shard_count)`` (``jax.process_index()``, ``jax.process_count()``) and returns that shard's
stream of examples; a ``grain.MapDataset`` is sliced ``[shard_index::shard_count]`` (Grain's
`ShardByJaxProcess` rule) and streamed. Examples are batched with Grain's ``.batch`` into
this process's rows of the global batch (``global_batch_size // process_count``), the last
partial batch dropped; a finite stream ends the run cleanly (``data_exhausted``). Resuming
needs the same number of processes (each restores its own shard's state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from trainers.data.batch import Batch
from trainers.data.grain_source import import_grain
from trainers.data.step_indexed import process_rows

#: ``(seed, shard_index, shard_count) -> this shard's stream of examples``.
StreamFactory = Callable[[int, int, int], Any]


class StreamIterator:
    """This process's batches of a stream, with Grain's ``get_state``/``set_state``.

    Args:
      iterator: a Grain ``DatasetIterator`` of batches (dicts of arrays).
      skip: batches to skip before the first one yielded, unless `set_state` is called first
        (a resume without saved data state).
      name: what the data is, for error messages.
    """

    def __init__(self, iterator: Any, *, skip: int = 0, name: str = "the stream"):
        self._iterator = iterator
        self._skip = skip
        self.name = name

    def __iter__(self) -> StreamIterator:
        return self

    def __next__(self) -> Batch:
        while self._skip > 0:
            self._skip -= 1
            next(self._iterator)
        batch = next(self._iterator)
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"{self.name}: elements must be dicts of arrays (batch key -> value), got a "
                f"{type(batch).__name__}."
            )
        return {k: np.asarray(v) for k, v in batch.items()}

    def get_state(self) -> Any:
        """The stream's position: Grain's iterator state (JSON-able), after the batches
        yielded so far."""
        if self._skip:  # not started yet: skip now, so that the state counts the skipped ones
            for _ in range(self._skip):
                next(self._iterator)
            self._skip = 0
        return self._iterator.get_state()

    def set_state(self, state: Any) -> None:
        """Moves the stream to a position `get_state` returned (skips nothing more)."""
        self._skip = 0
        self._iterator.set_state(state)


class StreamData:
    """A stream of examples as a task's data (module docstring).

    Args:
      dataset: a factory ``(seed, shard_index, shard_count) -> grain.IterDataset`` of
        examples (each a dict of arrays); or a ``grain.MapDataset``, sliced per process and
        streamed; or, in a run of one process, a ``grain.IterDataset``.
      name: what the data is, for error messages.

    Raises:
      ImportError: if Grain is not installed.
      TypeError: if `dataset` is none of these.
    """

    def __init__(self, dataset: Any, *, name: str = "the stream"):
        grain = import_grain()
        if not (callable(dataset) or isinstance(dataset, grain.MapDataset | grain.IterDataset)):
            raise TypeError(
                f"{name}: expected a factory (seed, shard_index, shard_count) -> "
                f"grain.IterDataset, a grain.MapDataset or a grain.IterDataset, got "
                f"{type(dataset).__name__}."
            )
        self.dataset = dataset
        self.name = name

    def shard(self, seed: int, shard_index: int, shard_count: int) -> Any:
        """This process's stream of examples, as a ``grain.IterDataset``.

        Raises:
          ValueError: a ``grain.IterDataset`` given for a run of several processes (it cannot
            be split without reading all of it on every process).
        """
        grain = import_grain()
        dataset = self.dataset
        if isinstance(dataset, grain.MapDataset):
            return dataset[shard_index::shard_count].to_iter_dataset()
        if isinstance(dataset, grain.IterDataset):
            if shard_count > 1:
                raise ValueError(
                    f"{self.name}: a grain.IterDataset cannot be split over {shard_count} "
                    "processes; give a factory (seed, shard_index, shard_count) -> IterDataset "
                    "that reads shard shard_index of shard_count."
                )
            return dataset
        stream = dataset(seed, shard_index, shard_count)
        if isinstance(stream, grain.MapDataset):
            stream = stream.to_iter_dataset()
        if not isinstance(stream, grain.IterDataset):
            raise TypeError(
                f"{self.name}: the factory returned a {type(stream).__name__}, not a "
                "grain.IterDataset."
            )
        return stream

    def batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> StreamIterator:
        """This process's batches from step `start_step` (`trainers.data.source.DataSource`).

        Args:
          global_batch_size: rows of the global batch; divisible by `process_count`.
          seed: the data seed, given to the factory.
          start_step: batches to skip unless the trainer restores the saved state.
          process_index: this process (its shard).
          process_count: number of processes (shards).

        Returns:
          A `StreamIterator` of ``global_batch_size // process_count`` rows per batch.
        """
        lo, hi = process_rows(global_batch_size, start_step, process_index, process_count)
        stream = self.shard(seed, process_index, process_count)
        iterator = iter(stream.batch(hi - lo, drop_remainder=True))
        return StreamIterator(iterator, skip=start_step, name=self.name)
