"""The task: xshard's `NNXTask` plus an eval split read through Grain.

`NNXTask` takes the model, the train data and the loss from config; this subclass adds
``eval_batches`` (docs/tasks.md, "Evaluation"), so the trainer logs ``eval/loss``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trainers.tasks.flax_nnx import NNXTask


class RegressionTask(NNXTask):
    """An NNX model trained on `data` and evaluated on `eval_data`.

    Args:
      model: the model factory (the ``task.model`` node).
      data: the train split (a `trainers.data.DataSource`).
      eval_data: the eval split (a finite `DataSource`, read from its start); None: no eval.
      **kwargs: the other arguments of `NNXTask` (loss, inputs, targets, logical_axis_rules,
        sync_batch_norm, name).
    """

    def __init__(self, model: Any, data: Any, eval_data: Any = None, **kwargs: Any):
        super().__init__(model, data, **kwargs)
        self.eval_data = eval_data

    @property
    def has_eval_split(self) -> bool:
        """Whether an eval split was given."""
        return self.eval_data is not None

    def eval_batches(
        self, global_batch_size: int, *, seed: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[dict]:
        """This process's rows of the eval split's global batches, from the first.

        Args:
          global_batch_size: rows of an eval global batch.
          seed: the run's data seed (the eval split is not shuffled).
          process_index: this process.
          process_count: number of processes.

        Returns:
          An iterator over the eval split's batches (one pass).
        """
        return self.eval_data.batches(
            global_batch_size,
            seed=seed,
            start_step=0,
            process_index=process_index,
            process_count=process_count,
        )
