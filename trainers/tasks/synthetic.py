"""Data sources without a model, for tasks whose data is configured separately (Flax tasks).

`TeacherRegression` yields exactly the batches of ``task=mlp`` (`trainers.tasks.mlp.MLPTask`)
for the same arguments: x ~ N(0, I) and y from a fixed random teacher MLP, a pure function of
(seed, step), and the same held-out eval split. Any object with the same ``batches`` method
can replace it (`trainers.tasks.flax_common`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainers.data.batch import Batch
from trainers.data.step_indexed import StepIndexedData, StepIndexedEvalData
from trainers.tasks.mlp import MLPTask


class TeacherRegression(StepIndexedData, StepIndexedEvalData):
    """Teacher-student regression data: ``{"x": (n, in_dim), "y": (n, out_dim)}`` float32.

    Args:
      in_dim: input dimension.
      out_dim: output dimension.
      teacher_hidden: hidden sizes of the teacher MLP (tanh).
      teacher_seed: seed of the teacher's weights.
      noise_std: standard deviation of Gaussian noise on the targets.
      num_examples: if set, the data is finite: ``num_examples // global_batch_size`` steps.
    """

    def __init__(
        self,
        in_dim: int = 16,
        out_dim: int = 4,
        teacher_hidden: Sequence[int] = (32,),
        teacher_seed: int = 1234,
        noise_std: float = 0.0,
        num_examples: int | None = None,
    ):
        self._source = MLPTask(
            in_dim=in_dim,
            out_dim=out_dim,
            teacher_hidden=teacher_hidden,
            teacher_seed=teacher_seed,
            noise_std=noise_std,
            num_examples=num_examples,
        )

    def num_data_steps(self, global_batch_size: int) -> int | None:
        """Steps of data at this batch size; None for endless data."""
        return self._source.num_data_steps(global_batch_size)

    def global_batch(self, global_batch_size: int, *, seed: int, step: int) -> Batch:
        """The global batch of `step`: the same as ``task=mlp``'s."""
        return self._source.global_batch(global_batch_size, seed=seed, step=step)

    def global_eval_batch(self, global_batch_size: int, *, seed: int, index: int) -> Batch:
        """Held-out eval batch `index`: the same as ``task=mlp``'s."""
        return self._source.global_eval_batch(global_batch_size, seed=seed, index=index)
