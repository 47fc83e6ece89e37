"""What the sections of a run hand on (`trainers.app.training`): where it trains, and the
state it starts from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from trainers.cluster.multihost import Cluster
from trainers.cluster.run_dirs import RunDirs


class Placement(NamedTuple):
    """Where the run trains: its processes, their shared dirs and the device mesh."""

    cluster: Cluster
    dirs: RunDirs
    mesh: Any
    data_axes: tuple[str, ...]


class Started(NamedTuple):
    """The state training starts from, and the data from its step on (a checkpointable
    iterator already at the saved position: `trainers.checkpoint.data_state`); `first` is the
    run's first batch (its shapes compile the steps; ``grad_impl=auto`` times steps on it);
    `source` the checkpoint the state was restored from (None: a new state, or an elastic
    group's healed from a live peer at another step)."""

    state: Any
    start_step: int
    data: Iterator[Any]
    evaluator: Any
    config: dict[str, Any]
    first: Any = None
    source: Any = None
