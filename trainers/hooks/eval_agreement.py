"""How the processes agree on an evaluation's batches: as many on each, padding laid out alike.

A process's share of a finite eval split may hold fewer batches than another's, or none; the
eval step is a collective program, so every process must run it as often as the one with the
most batches, padding the batches it lacks (`trainers.data.padding`). `agreed_batches` finds
that count and, for a process with no batch at all, the layout of the rows it pads, in one
exchange over the cluster's own collective (`AllGather`: the run hands in
`trainers.cluster.multihost.Cluster.all_gather`; the hooks never import the cluster).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainers.data.batch import Batch
from trainers.data.padding import empty_batch, row_layout

#: Every process's JSON-able value, in process order; the name is unique per call and the
#: same on every process (`trainers.cluster.multihost.Cluster.all_gather`).
AllGather = Callable[[str, Any], list[Any]]


def agreed_batches(
    count: int, first: Batch | None, *, all_gather: AllGather, name: str
) -> tuple[int, Batch | None]:
    """The most eval batches any process has, and a batch to lay padding out like.

    Every process calls it (a collective). Each hands in its batch count and the layout of
    its first batch's rows (`trainers.data.padding.row_layout`); a process whose split yields
    no batch while another's does gets an empty batch laid out like the first such process's,
    so it pads as many batches as the others score.

    Args:
      count: this process's eval batches.
      first: its first one (None: it has none).
      all_gather: the cluster's exchange of small values.
      name: this exchange's name, unique per call.

    Returns:
      ``(most batches of any process, first or an empty batch like another's)``; the batch
      is None only when no process has any.
    """
    mine = [count, None if first is None else row_layout(first)]
    everyone = all_gather(name, mine)
    most = max(int(theirs) for theirs, _ in everyone)
    if first is not None or most == 0:
        return most, first
    layout = next(layout for _, layout in everyone if layout is not None)
    return most, empty_batch(layout)


def one_process(name: str, value: Any) -> list[Any]:
    """The `AllGather` of a run of one process: its own value."""
    del name
    return [value]
