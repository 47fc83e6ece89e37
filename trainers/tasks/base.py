"""The contract between the generic trainer and a task (model + data).

A task is any object with these members; the trainer knows nothing else about the model.
Batches are dicts of host-local NumPy arrays whose leading axis is this process's share of the
global batch. `batches` is a pure function of (seed, step): the batch at step k is the same on
every run, which is what makes exact resume possible without saving an iterator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import PartitionSpec

from trainers.data.batch import Batch

Params = Any


class Task(Protocol):
    """What the trainer needs from a task."""

    #: (regex on the parameter path, PartitionSpec over model axes). First match wins;
    #: unmatched parameters are replicated. Paths look like "blocks/0/attn/wq".
    sharding_rules: Sequence[tuple[str, PartitionSpec]]

    # Optional: example_shapes() -> {name: jax.ShapeDtypeStruct}, the shapes of one example (no
    # batch dimension): the run checks its memory from them before making any data
    # (`trainers.app.memory_preflight`).

    # Optional: tokens per example (a sequence task's length), for ``perf/tokens_per_sec``.
    # Tasks without it log examples per second only (`tokens_per_example` reads it).

    # Optional, evaluation (`trainers.hooks.evaluation`): a task with an eval split has
    #   eval_batches(global_batch_size, *, seed, process_index=0, process_count=1)
    #       -> Iterator[Batch]: this process's rows of the eval split's global batches, the
    #       same ones (from the first) on every call; `StepIndexedEvalData` implements it.
    #   has_eval_split: bool (optional; False turns the split off, e.g. nothing held out).
    #   eval_metrics(params, batch) -> dict[str, jax.Array] (optional): scalar means over the
    #       batch, "loss" among them; without it evaluation uses `loss` with a fixed RNG. A
    #       task with model state (`trainers.core.model_state`) takes (params, model_state, batch).
    #       With a `mask` keyword (1.0 real row, 0.0 padding) it returns masked means; without
    #       one it is called per example (`trainers.hooks.eval_scoring`). The last eval batch may
    #       be short: the evaluation pads and masks it, scoring every example once.

    def init(self, rng: jax.Array, batch: Batch) -> Params:
        """Returns freshly initialised params for an example batch."""
        ...

    def loss(self, params: Params, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict]:
        """Returns (mean loss over the batch, dict of scalar aux metrics)."""
        ...

    def batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """Yields this process's slice of the global batch for steps start_step, +1, ...

        A finite dataset ends the iterator; the trainer then stops cleanly.
        """
        ...


class StatefulTask(Task, Protocol):
    """A task whose model carries state besides its params (batch statistics, ...):
    `trainers.core.model_state.is_stateful` tells one apart."""

    def init_with_state(self, rng: jax.Array, batch: Batch) -> tuple[Params, Any]:
        """Returns (params, model state) for an example batch."""
        ...

    def loss_with_state(
        self, params: Params, model_state: Any, batch: Batch, rng: jax.Array
    ) -> tuple[jax.Array, dict, Any]:
        """Returns (mean loss, dict of scalar aux metrics, the new model state)."""
        ...


class EvalTask(Task, Protocol):
    """A task with an eval split (`trainers.hooks.evaluation.has_eval_split` tells one apart;
    the optional members above say what the evaluation reads)."""

    def eval_batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """This process's rows of the eval split's global batches, the same on every call."""
        ...


def tokens_per_example(task: Task) -> int | None:
    """The task's ``tokens_per_example`` attribute if it has a positive one, else None."""
    value = getattr(task, "tokens_per_example", None)
    return (
        int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
    )
