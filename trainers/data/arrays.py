"""NumPy arrays as examples, read in epochs (`EpochData`): named arrays (`ArrayData`) and a
token stream cut into windows (`TokenWindows`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trainers.data.batch import Batch
from trainers.data.source import EpochData


class ArrayData(EpochData):
    """Rows of named arrays as examples, shuffled per (seed, epoch) with NumPy.

    Epoch ``e``'s order is ``np.random.default_rng([seed, e]).permutation(n)`` (or ``0..n-1``
    without shuffling); each process reads only its own rows (`EpochData`).

    Args:
      arrays: batch key -> array whose leading axis is the examples (the same length for all).
        Memory-mapped arrays (``np.load(..., mmap_mode="r")``) are read row by row as needed.
      shuffle: a new order each epoch; False: the arrays' order.
      num_epochs: epochs before the data ends; None: endless.
      name: what the data is, for error messages.

    Raises:
      ValueError: if there are no arrays, an array has no leading axis, or the arrays differ
        in length.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        name: str = "the data",
    ):
        if not arrays:
            raise ValueError(f"{name}: no arrays given.")
        lengths = {k: (np.shape(v)[0] if np.ndim(v) else None) for k, v in arrays.items()}
        if None in lengths.values() or len(set(lengths.values())) != 1:
            raise ValueError(
                f"{name}: every array needs the same number of rows (one per example); got "
                + ", ".join(f"{k}: {np.shape(v)}" for k, v in arrays.items())
            )
        rows = next(iter(lengths.values()))
        assert rows is not None  # checked above
        super().__init__(rows, shuffle=shuffle, num_epochs=num_epochs, name=name)
        self.arrays = dict(arrays)
        self._orders = _EpochOrders()

    def read(self, seed: int, epoch: int, start: int, stop: int) -> Batch:
        """The examples at positions ``[start, stop)`` of epoch `epoch`'s order."""
        index = self._orders.get(seed, epoch, self.num_examples, self.shuffle)[start:stop]
        return {k: np.asarray(v[index]) for k, v in self.arrays.items()}


class TokenWindows(EpochData):
    """A token stream cut into windows of ``seq_len + 1`` tokens, one example each.

    Example ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len + 1]`` (windows overlap by the
    one token that is both the last target of one and the first input of the next), split into
    ``inputs`` (its first ``seq_len`` tokens) and ``targets`` (its last ``seq_len``), int32.
    Windows are cut when read, so the stream may be memory-mapped.

    Args:
      tokens: a 1-D array of token ids, at least ``seq_len + 1`` long.
      seq_len: tokens per example.
      shuffle: a new order of the windows each epoch; False: stream order.
      num_epochs: epochs before the data ends; None: endless.
      name: what the data is, for error messages.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        name: str = "the tokens",
    ):
        if np.ndim(tokens) != 1 or len(tokens) < seq_len + 1:
            raise ValueError(
                f"{name}: expected a 1-D stream of at least seq_len + 1 = {seq_len + 1} "
                f"tokens, got shape {np.shape(tokens)}."
            )
        super().__init__(
            (len(tokens) - 1) // seq_len, shuffle=shuffle, num_epochs=num_epochs, name=name
        )
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self._orders = _EpochOrders()

    def read(self, seed: int, epoch: int, start: int, stop: int) -> Batch:
        """The windows at positions ``[start, stop)`` of epoch `epoch`'s order."""
        index = self._orders.get(seed, epoch, self.num_examples, self.shuffle)[start:stop]
        windows = self.tokens[index[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
        windows = windows.astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class _EpochOrders:
    """Epoch `e`'s order of `n` examples: ``default_rng([seed, e]).permutation(n)`` when
    shuffling, else ``0..n-1``; the last one is cached (a run reads one epoch at a time)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[int, int], np.ndarray] | None = None

    def get(self, seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
        if self._last is None or self._last[0] != (seed, epoch):
            order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
            self._last = ((seed, epoch), order)
        return self._last[1]
