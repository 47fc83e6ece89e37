"""Data for tasks whose batch at step k is a pure function of (seed, k).

`StepIndexedData` implements the `batches` method of the task contract from one method,
`global_batch(global_batch_size, *, seed, step)`: every process builds the same global batch
and keeps its own rows, so exact resume needs no iterator state and the data does not depend
on the number of processes. `StepIndexedEvalData` does the same for a held-out eval split
(`eval_batches`, from `global_eval_batch(global_batch_size, *, seed, index)`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator

import numpy as np

from trainers.data.batch import Batch


def process_rows(
    global_batch_size: int, start_step: int, process_index: int, process_count: int
) -> tuple[int, int]:
    """This process's rows ``[lo, hi)`` of each global batch: ``[p * n / P, (p + 1) * n / P)``.

    Args:
      global_batch_size: rows of the global batch, `n`.
      start_step: the first step; checked to be >= 0.
      process_index: this process, `p`, in ``[0, process_count)``.
      process_count: processes sharing the global batch, `P`.

    Returns:
      ``(lo, hi)``.

    Raises:
      ValueError: the batch size is not positive or not divisible by `process_count`,
        `process_index` is out of range, or `start_step` is negative.
    """
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index {process_index} must be in [0, process_count={process_count})"
        )
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by the number of "
            f"processes {process_count}"
        )
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    rows = global_batch_size // process_count
    return process_index * rows, (process_index + 1) * rows


def process_batches(
    make_global_batch: Callable[[int], dict[str, np.ndarray]],
    global_batch_size: int,
    *,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    num_steps: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Yields this process's rows of `make_global_batch(step)` for step = start_step, +1, ...

    Every process builds the same global batch (a pure function of the step) and keeps rows
    `[p * n / P, (p + 1) * n / P)`, so the data does not depend on the number of processes.

    Args:
      make_global_batch: step -> dict of arrays whose leading axis is `global_batch_size`.
      global_batch_size: rows in the global batch.
      start_step: first step to yield.
      process_index: this process, in `[0, process_count)`.
      process_count: number of processes sharing the global batch.
      num_steps: if set, the data is finite: the iterator ends before step `num_steps`.

    Returns:
      An iterator of dicts of arrays with `global_batch_size // process_count` rows (fewer,
      or none, where `make_global_batch` returns a short batch).

    Raises:
      ValueError: the batch size is not positive or not divisible by `process_count`, or
        `process_index` is out of range.
    """
    lo, hi = process_rows(global_batch_size, start_step, process_index, process_count)

    def generate() -> Iterator[dict[str, np.ndarray]]:
        step = start_step
        while num_steps is None or step < num_steps:
            yield {k: v[lo:hi] for k, v in make_global_batch(step).items()}
            step += 1

    return generate()  # a plain function, so bad arguments raise at the call, not at next()


class StepIndexedData(abc.ABC):
    """Base for tasks whose global batch is a pure function of (seed, step)."""

    @abc.abstractmethod
    def global_batch(self, global_batch_size: int, *, seed: int, step: int) -> Batch:
        """The whole global batch of `step` (every process computes the same one)."""

    def num_data_steps(self, global_batch_size: int) -> int | None:
        """Steps of data there are at this batch size; None for endless data."""
        return None

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
          An iterator of batches with `global_batch_size // process_count` rows; it ends
          after `num_data_steps(global_batch_size)` steps when that is not None.
        """
        return process_batches(
            lambda step: self.global_batch(global_batch_size, seed=seed, step=step),
            global_batch_size,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
            num_steps=self.num_data_steps(global_batch_size),
        )


class StepIndexedEvalData(abc.ABC):
    """Base for tasks with a held-out eval split whose batch `index` is a pure function of
    (seed, index): implements the optional `eval_batches` member of the task contract.

    Every evaluation reads the same batches from index 0, so evaluations are comparable. A
    finite split's last global batch may be short: each process keeps its rows of it (a
    short or empty share), and the evaluation pads and masks them, so every example is
    scored once (`trainers.hooks.evaluation`).
    """

    @abc.abstractmethod
    def global_eval_batch(self, global_batch_size: int, *, seed: int, index: int) -> Batch:
        """The whole global eval batch number `index` (every process computes the same one):
        `global_batch_size` rows, fewer in the last batch of a finite split."""

    def num_eval_batches(self, global_batch_size: int) -> int | None:
        """Eval batches there are at this batch size, the last one short if need be; None
        for an endless eval split."""
        return None

    def eval_batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """Yields this process's rows of the eval split's global batches 0, 1, ...

        Args:
          global_batch_size: rows of the global eval batch; divisible by `process_count`.
          seed: the data seed.
          process_index: this process.
          process_count: number of processes.

        Returns:
          An iterator of batches with `global_batch_size // process_count` rows (fewer, or
          none, in a short last batch); it ends after `num_eval_batches(global_batch_size)`
          batches when that is not None.
        """
        return process_batches(
            lambda index: self.global_eval_batch(global_batch_size, seed=seed, index=index),
            global_batch_size,
            process_index=process_index,
            process_count=process_count,
            num_steps=self.num_eval_batches(global_batch_size),
        )
