"""The data: a random-access source of (x, y) pairs read through a Grain `MapDataset`.

``y = tanh(x @ W)`` plus noise, for a fixed teacher ``W``. The train and eval splits are
disjoint ranges of example indices; each example is a pure function of its index, as a file
read by position would be. `split` wraps the source in Grain and xshard's `GrainData`, which
shuffles and batches it per (seed, epoch) and resumes exactly from a checkpoint's step.
`TeacherData` is the task's ``data`` node: xshard's Flax tasks train on its ``batches`` and
evaluate on its ``eval_batches``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np

from trainers.data.grain_source import GrainData

#: First example index of the eval split: never an index of the train split.
EVAL_OFFSET = 1_000_000


class TeacherExamples:
    """A random-access source (``__len__``, ``__getitem__``), like Grain's own sources.

    Args:
      num_examples: examples in the split.
      in_dim: input features.
      out_dim: outputs.
      offset: index of the first example (splits use disjoint ranges).
      noise_std: label noise.
    """

    def __init__(
        self, num_examples: int, in_dim: int, out_dim: int, offset: int = 0, noise_std: float = 0.05
    ):
        self.num_examples, self.in_dim, self.out_dim = num_examples, in_dim, out_dim
        self.offset, self.noise_std = offset, noise_std
        teacher = np.random.default_rng(1234).standard_normal((in_dim, out_dim))
        self.teacher = (teacher / np.sqrt(in_dim)).astype(np.float32)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([7, self.offset + int(index)])
        x = rng.standard_normal(self.in_dim).astype(np.float32)
        noise = self.noise_std * rng.standard_normal(self.out_dim)
        return {"x": x, "y": (np.tanh(x @ self.teacher) + noise).astype(np.float32)}


def clip_inputs(example: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An element-wise Grain ``.map``: clips outlying inputs to [-3, 3]."""
    return {**example, "x": np.clip(example["x"], -3.0, 3.0)}


def split(
    name: str,
    num_examples: int,
    in_dim: int,
    out_dim: int,
    num_epochs: int | None = None,
) -> GrainData:
    """One split of the data as xshard's `GrainData`.

    Args:
      name: ``train`` (shuffled per epoch, ``num_epochs`` passes, None: endless) or ``eval``
        (the dataset's order, one pass: the same batches at every evaluation).
      num_examples: examples in the split.
      in_dim: input features.
      out_dim: outputs.
      num_epochs: passes over the train split (ignored for ``eval``).

    Returns:
      The split, with ``batches(global_batch_size, *, seed, start_step, process_index,
      process_count)``.

    Raises:
      ValueError: for an unknown split name.
    """
    if name not in ("train", "eval"):
        raise ValueError(f"split name {name!r}: expected 'train' or 'eval'")
    train = name == "train"
    source = TeacherExamples(num_examples, in_dim, out_dim, offset=0 if train else EVAL_OFFSET)
    dataset = grain.MapDataset.source(source).map(clip_inputs)
    return GrainData(
        dataset,
        shuffle=train,
        num_epochs=num_epochs if train else 1,
        name=f"the {name} split",
    )


class TeacherData:
    """The train split and a held-out eval split: a `trainers.data.DataSource` with
    ``eval_batches``, as xshard's Flax tasks expect of ``task.data``.

    Args:
      in_dim: input features.
      out_dim: outputs.
      num_train: examples in the train split.
      num_eval: examples in the eval split.
      num_epochs: passes over the train split (None: endless).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_train: int = 2048,
        num_eval: int = 256,
        num_epochs: int | None = None,
    ):
        self.train = split("train", num_train, in_dim, out_dim, num_epochs)
        self.eval = split("eval", num_eval, in_dim, out_dim)

    def batches(self, global_batch_size: int, **kwargs) -> Iterator[dict[str, np.ndarray]]:
        """The train split's batches (``seed``, ``start_step``, ``process_index``,
        ``process_count`` as in `trainers.data.DataSource.batches`)."""
        return self.train.batches(global_batch_size, **kwargs)

    def eval_batches(
        self, global_batch_size: int, *, seed: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """This process's rows of the eval split's batches: one pass in order, every example
        once (the last batch is short; xshard pads and masks it).

        Args:
          global_batch_size: rows of an eval global batch.
          seed: the run's data seed (the eval split is not shuffled).
          process_index: this process.
          process_count: number of processes.

        Returns:
          An iterator over the eval split's batches.
        """
        return self.eval.eval_batches(
            global_batch_size, seed=seed, process_index=process_index, process_count=process_count
        )
