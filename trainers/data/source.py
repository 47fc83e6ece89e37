"""The data interface a task can delegate to, and finite datasets read in shuffled epochs.

`DataSource` is the data half of the task contract (`trainers.tasks.base.Task.batches`): any
object with that `batches` method feeds the trainer, so a task holds one and delegates::

    def batches(self, global_batch_size, **kwargs):
        return self.data.batches(global_batch_size, **kwargs)

`EpochData` implements it for a finite set of examples, read by position, in epochs:

- step ``k`` is batch ``j = k % S`` of epoch ``e = k // S``, with ``S = examples // batch``
  steps per epoch (the last ``examples % batch`` examples of each epoch's order are left out);
- epoch ``e`` reads the examples in an order that is a pure function of ``(seed, e)``
  (shuffled, a new order each epoch) or in file order (``shuffle=False``);
- process ``p`` of ``P`` reads only positions ``[j * B + p * B / P, j * B + (p + 1) * B / P)``
  of that order, so the processes' rows make up the global batch without overlap, and the
  global batch does not depend on the number of processes.

So the position in the data is a pure function of the step, which the checkpoint saves: a
resumed run reads exactly the batches an uninterrupted one would, with no iterator state.
Subclasses say how to read positions of an epoch: `trainers.data.arrays.ArrayData` (NumPy
arrays, e.g. from a file) and `trainers.data.grain_source.GrainData` (a Grain `MapDataset`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from trainers.data.batch import Batch
from trainers.data.step_indexed import process_rows
from xshard.errors import ConfigError


@runtime_checkable
class DataSource(Protocol):
    """Anything that yields a task's batches; the signature of `Task.batches`."""

    def batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """Yields this process's rows of the global batch for steps start_step, +1, ...

        Must be a pure function of (seed, step) for exact resume; a finite iterator ends the
        run cleanly.
        """
        ...


class EpochData(abc.ABC):
    """A finite dataset read in epochs, shuffled per (seed, epoch), split per process.

    Args:
      num_examples: examples in one epoch.
      shuffle: a new order each epoch (from the seed and the epoch); False: file order.
      num_epochs: epochs before the data ends; None: endless.
      name: what the data is, for error messages (``task.data.path='my.npz'``).
    """

    def __init__(
        self,
        num_examples: int,
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        name: str = "the data",
    ):
        if num_examples <= 0:
            raise ValueError(f"{name} has no examples.")
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"{name}: num_epochs={num_epochs} must be >= 1 or None.")
        self.num_examples = int(num_examples)
        self.shuffle = bool(shuffle)
        self.num_epochs = None if num_epochs is None else int(num_epochs)
        self.name = name

    @abc.abstractmethod
    def read(self, seed: int, epoch: int, start: int, stop: int) -> Batch:
        """Examples at positions ``[start, stop)`` of epoch `epoch`'s order, as one batch.

        Args:
          seed: the data seed.
          epoch: the epoch (its order is a pure function of `seed` and `epoch`).
          start: first position, ``0 <= start < stop <= num_examples``.
          stop: one past the last position.

        Returns:
          A dict of arrays with ``stop - start`` rows.
        """

    def steps_per_epoch(self, global_batch_size: int) -> int:
        """Steps in one epoch: ``num_examples // global_batch_size``.

        Raises:
          ConfigError: if there are fewer examples than one global batch.
        """
        steps = self.num_examples // global_batch_size
        if steps == 0:
            raise ConfigError(
                f"{self.name} has {self.num_examples} examples, fewer than one global batch "
                f"of {global_batch_size}: choose trainer.batch_size <= {self.num_examples} or "
                "add examples."
            )
        return steps

    def num_data_steps(self, global_batch_size: int) -> int | None:
        """Steps of data at this batch size: ``num_epochs * steps_per_epoch``; None: endless."""
        if self.num_epochs is None:
            return None
        return self.num_epochs * self.steps_per_epoch(global_batch_size)

    def position(self, step: int, global_batch_size: int) -> tuple[int, int]:
        """``(epoch, first position in the epoch's order)`` of the global batch of `step`."""
        epoch, batch = divmod(step, self.steps_per_epoch(global_batch_size))
        return epoch, batch * global_batch_size

    def batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """Yields this process's rows of the global batch for steps start_step, +1, ...

        Args:
          global_batch_size: rows of the global batch; divisible by `process_count`.
          seed: the data seed.
          start_step: the first step (for exact resume).
          process_index: this process.
          process_count: number of processes.

        Returns:
          An iterator of batches with ``global_batch_size // process_count`` rows; it ends
          after `num_data_steps` steps when `num_epochs` is set.

        Raises:
          ConfigError: if there are fewer examples than one global batch.
          ValueError: for a bad split (see `trainers.data.step_indexed.process_rows`).
        """
        lo, hi = process_rows(global_batch_size, start_step, process_index, process_count)
        self.steps_per_epoch(global_batch_size)  # one batch fits, or a ConfigError now
        end = self.num_data_steps(global_batch_size)

        def generate() -> Iterator[Batch]:
            step = start_step
            while end is None or step < end:
                epoch, first = self.position(step, global_batch_size)
                yield self.read(seed, epoch, first + lo, first + hi)
                step += 1

        return generate()  # a plain function: bad arguments raise at the call, not at next()

    def eval_batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """One pass over the examples as an eval split: every example exactly once.

        Global batch ``j`` is positions ``[j * B, (j + 1) * B)`` of epoch 0's order (the
        dataset's order when not shuffling), the last one holding the remainder; process
        ``p`` reads its slice of each, which may be short or empty in the last batch. The
        evaluation pads and masks short batches (`trainers.hooks.evaluation`), so no example
        is dropped and none counts twice.

        Args:
          global_batch_size: rows of a global eval batch; divisible by `process_count`.
          seed: the data seed (the order of a shuffled dataset's epoch 0).
          process_index: this process.
          process_count: number of processes.

        Returns:
          ``ceil(num_examples / global_batch_size)`` batches on every process.
        """
        lo, hi = process_rows(global_batch_size, 0, process_index, process_count)
        n = self.num_examples

        def generate() -> Iterator[Batch]:
            for first in range(0, n, global_batch_size):
                start, stop = min(first + lo, n), min(first + hi, n)
                if stop > start:
                    yield self.read(seed, 0, start, stop)
                else:  # this process's share of the last batch is empty
                    yield {k: v[:0] for k, v in self.read(seed, 0, 0, 1).items()}

        return generate()
