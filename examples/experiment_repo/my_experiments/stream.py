"""Streaming data: the train split as a Grain `IterDataset`, read through xshard's `StreamData`.

A stream has no random access: here a filter drops examples (which a `MapDataset` read by
position cannot do), so the position in the data is the iterator's state, not a function of
the step. xshard saves that state with every checkpoint and restores it on resume
(docs/tasks.md, "A stream: StreamData"), so a run killed with ``kill -9`` and rerun reads on
exactly where its checkpoint was. Each process reads its own shard of the source.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from my_experiments.data import TeacherExamples, clip_inputs, split
from trainers.data.stream import StreamData


def inside(example: dict[str, np.ndarray]) -> bool:
    """Keeps the examples whose first input lies within 2.5 standard deviations."""
    return bool(abs(example["x"][0]) < 2.5)


def teacher_stream(
    seed: int, shard_index: int, shard_count: int, *, in_dim: int, out_dim: int, num_examples: int
) -> Any:
    """Shard `shard_index` of `shard_count` of the train examples as an endless stream.

    Args:
      seed: the run's data seed (the shuffle).
      shard_index: this process (``jax.process_index()``).
      shard_count: number of processes.
      in_dim: input features.
      out_dim: outputs.
      num_examples: examples in the train split (all shards).

    Returns:
      A ``grain.IterDataset`` of examples (dicts of arrays).
    """
    source = TeacherExamples(num_examples, in_dim, out_dim)
    shard = grain.MapDataset.source(source)[shard_index::shard_count]
    return shard.shuffle(seed=seed).repeat().to_iter_dataset().map(clip_inputs).filter(inside)


class StreamingTeacherData:
    """The train split as a stream, and the held-out eval split read once in order.

    Args:
      in_dim: input features.
      out_dim: outputs.
      num_train: examples in the train split.
      num_eval: examples in the eval split.
    """

    def __init__(self, in_dim: int, out_dim: int, num_train: int = 2048, num_eval: int = 200):
        stream = functools.partial(
            teacher_stream, in_dim=in_dim, out_dim=out_dim, num_examples=num_train
        )
        self.train = StreamData(stream, name="the train stream")
        self.eval = split("eval", num_eval, in_dim, out_dim)

    def batches(self, global_batch_size: int, **kwargs: Any) -> Iterator[dict[str, np.ndarray]]:
        """The stream's batches: a checkpointable iterator (``get_state``/``set_state``)."""
        return self.train.batches(global_batch_size, **kwargs)

    def eval_batches(
        self, global_batch_size: int, **kwargs: Any
    ) -> Iterator[dict[str, np.ndarray]]:
        """The eval split, every example once (``seed``, ``process_index``, ``process_count``)."""
        return self.eval.eval_batches(global_batch_size, **kwargs)
