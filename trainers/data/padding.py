"""Padding a short batch to a fixed number of rows, with a mask of the real ones.

A finite eval split rarely divides into whole batches, and one compiled program takes one
batch shape: the last, short batch is padded with zero rows, and a mask (1.0 for a real row,
0.0 for padding) says which rows to score (`trainers.hooks.eval_scoring`). A process whose
share of a global batch is empty, or that has no batch left while another process still has
one, pads a batch of nothing but padding, so every process runs the same number of steps.
A process that has no batch at all pads batches laid out like another process's
(`row_layout`, `empty_batch`: the layout travels between processes as JSON).
"""

from __future__ import annotations

import numpy as np

from trainers.data.batch import Batch

#: dtype of the mask: a weight per row, 1.0 real and 0.0 padding.
MASK_DTYPE = np.float32


def pad_rows(batch: Batch, rows: int) -> tuple[Batch, np.ndarray]:
    """`batch` with zero rows appended up to `rows`, and its mask.

    Args:
      batch: a dict of arrays with the same leading dimension, at most `rows`.
      rows: the rows of the padded batch.

    Returns:
      ``(padded batch, mask)``: the mask has shape ``(rows,)``, 1.0 for the batch's own rows.

    Raises:
      ValueError: if the arrays disagree on their rows, or have more than `rows`.
    """
    sizes = {np.shape(v)[0] for v in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"the batch's arrays have different numbers of rows: {sorted(sizes)}")
    real = sizes.pop()
    if real > rows:
        raise ValueError(f"a batch of {real} rows is larger than the batch size {rows}")
    padded = {k: _pad(np.asarray(v), rows) for k, v in batch.items()}
    mask = np.zeros((rows,), MASK_DTYPE)
    mask[:real] = 1
    return padded, mask


def padding_like(template: Batch, rows: int) -> tuple[Batch, np.ndarray]:
    """A batch of `rows` zero rows shaped like `template`'s rows, and its all-zero mask."""
    return pad_rows({k: np.asarray(v)[:0] for k, v in template.items()}, rows)


def row_layout(batch: Batch) -> dict[str, list]:
    """The layout of `batch`'s rows, JSON-able: ``{key: [dtype, *row shape]}``."""
    return {k: [np.asarray(v).dtype.str, *np.shape(v)[1:]] for k, v in batch.items()}


def empty_batch(layout: dict[str, list]) -> Batch:
    """A batch of zero rows with the `row_layout` `layout`."""
    return {k: np.zeros((0, *shape), np.dtype(dtype)) for k, (dtype, *shape) in layout.items()}


def _pad(array: np.ndarray, rows: int) -> np.ndarray:
    if array.shape[0] == rows:
        return array
    pad = np.zeros((rows - array.shape[0], *array.shape[1:]), array.dtype)
    return np.concatenate([array, pad])
