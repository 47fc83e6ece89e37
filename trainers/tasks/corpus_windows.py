"""A task's data as windows of a token corpus: random training windows, a held-out eval tail.

`CorpusWindows` gives a task (`trainers.tasks.tiny_gpt`) the data side of the `Task` protocol
over the byte tokens of `trainers.tasks.corpus`: training batches are random windows of
``seq_len + 1`` tokens from the corpus before ``eval_start``, a pure function of (seed, step);
the eval split is the tail from ``eval_start`` cut into consecutive windows, the same in every
evaluation. With a ``task.data`` file (``data`` not None) the batches are that file's and
there is no eval split.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from trainers.data.batch import Batch
from trainers.data.step_indexed import StepIndexedData, StepIndexedEvalData
from trainers.tasks import corpus


class CorpusWindows(StepIndexedData, StepIndexedEvalData):
    """The data of a task trained on windows of the corpus (or of a ``task.data`` file).

    The task sets the attributes below in its ``__init__``; this class only reads them.
    """

    #: The ``task.data`` file's tokens (`trainers.data.files.file_tokens`); None: the corpus.
    data: Any
    #: Tokens per window, not counting the one that the last position predicts.
    seq_len: int
    #: The corpus size cap in characters (`corpus.corpus_tokens`).
    corpus_max_chars: int
    #: The fraction of the corpus held out for evaluation (0: none).
    eval_fraction: float
    #: Tokens before this index are for training; the rest is the eval split.
    eval_start: int

    @property
    def tokens(self) -> np.ndarray:
        """The corpus as uint8 byte tokens (cached per process)."""
        return corpus.corpus_tokens(self.corpus_max_chars)

    def batches(self, global_batch_size: int, **kwargs: Any) -> Iterator[Batch]:
        """This process's batches: from the ``task.data`` file if set, else the corpus.

        Args and Returns as `StepIndexedData.batches` (keyword arguments passed on).
        """
        if self.data is not None:
            return self.data.batches(global_batch_size, **kwargs)
        return super().batches(global_batch_size, **kwargs)

    def num_data_steps(self, global_batch_size: int) -> int | None:
        """Steps of the ``task.data`` file's epochs, if set; the corpus is endless."""
        return None if self.data is None else self.data.num_data_steps(global_batch_size)

    def global_batch(self, global_batch_size: int, *, seed: int, step: int) -> Batch:
        """The whole global batch at `step`: random corpus windows, a pure function of (seed, step).

        Args:
          global_batch_size: rows.
          seed: the data seed.
          step: the training step.

        Returns:
          `{"inputs": int32 (n, seq_len), "targets": int32 (n, seq_len)}`, targets being the
          inputs shifted by one token.
        """
        tokens = self.tokens[: self.eval_start]
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(tokens) - self.seq_len, size=global_batch_size)
        windows = tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    @property
    def has_eval_split(self) -> bool:
        """Whether part of the corpus is held out (``eval_fraction > 0``); a run on the tokens
        of ``task.data.path`` has none (the corpus is not its data)."""
        return self.eval_fraction > 0 and self.data is None

    def _eval_windows(self) -> int:
        """Consecutive windows of ``seq_len + 1`` tokens (overlapping by one) in the eval split."""
        return (len(self.tokens) - self.eval_start - 1) // self.seq_len

    def num_eval_batches(self, global_batch_size: int) -> int:
        """Eval batches of `global_batch_size` windows that hold every window of the held-out
        tail once: the last one short unless they divide evenly."""
        return -(-self._eval_windows() // global_batch_size)

    def global_eval_batch(self, global_batch_size: int, *, seed: int, index: int) -> Batch:
        """Global eval batch `index`: windows ``index * n``, ... of the held-out tail (fewer
        than ``n`` in the last batch; the evaluation pads and masks it).

        Args:
          global_batch_size: rows (n).
          seed: unused: the eval split is the same for every run seed.
          index: the eval batch's number, below `num_eval_batches`.

        Returns:
          `{"inputs": int32 (rows, seq_len), "targets": int32 (rows, seq_len)}`, ``rows <= n``.
        """
        del seed
        tail = self.tokens[self.eval_start :]
        first = index * global_batch_size
        rows = max(0, min(global_batch_size, self._eval_windows() - first))
        starts = (first + np.arange(rows)) * self.seq_len
        windows = tail[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}
