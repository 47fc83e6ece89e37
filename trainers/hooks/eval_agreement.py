"""How the processes agree on an evaluation's batches: as many on each, padding laid out alike.

A process's share of a finite eval split may hold fewer batches than another's, or none; the
eval step is a collective program, so every process must run it as often as the one with the
most batches, padding the batches it lacks (`trainers.data.padding`). `agreed_batches` finds
that count and, for a process with no batch at all, the layout of the rows it pads.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from trainers.data.batch import Batch
from trainers.data.padding import empty_batch, row_layout


def agreed_batches(count: int, first: Batch | None) -> tuple[int, Batch | None]:
    """The most eval batches any process has, and a batch to lay padding out like.

    Every process calls it (collectives). A process whose split yields no batch while
    another's does gets an empty batch laid out like the first such process's (the layout
    is broadcast as JSON), so it pads as many batches as the others score.

    Args:
      count: this process's eval batches.
      first: its first one (None: it has none).

    Returns:
      ``(most batches of any process, first or an empty batch like another's)``; the batch
      is None only when no process has any.
    """
    if jax.process_count() == 1:
        return count, first
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int32(count))).reshape(-1)
    most = int(counts.max())
    if most == 0 or counts.min() > 0:
        return most, first
    source = int(np.argmax(counts > 0))  # every process agrees: the first with a batch
    is_source = jax.process_index() == source
    text = json.dumps(row_layout(first) if is_source and first is not None else {})
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text)), is_source=is_source))
    data = np.frombuffer(text.encode().ljust(size, b" ")[:size], np.uint8)
    data = multihost_utils.broadcast_one_to_all(data, is_source=is_source)
    layout = json.loads(np.asarray(data, np.uint8).tobytes().decode())
    return most, first if first is not None else empty_batch(layout)
