"""The train step's data: the state it updates (`TrainState`), its static description
(`StepSpec`), its result (`StepResult`, and `TrainStep`: the step function and what its metrics
mean), its RNG, a pure function of (seed, step) (`step_rng`), the shardings a state's
arrays keep (`state_shardings`), and its hyperparameter inputs placed (`placed_inputs`). The
step itself is `trainers.core.step.train_step`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class TrainState(NamedTuple):
    """Everything that changes during training. The RNG is a pure function of (seed, step)."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: optax.OptState
    #: Variables that change but are not trained (BatchNorm statistics, RNG counters):
    #: ``{}`` for a plain task (`trainers.core.model_state`).
    model_state: Any = {}  # never mutated; a NamedTuple default
    #: With a periodic mesh axis (local SGD, DiLoCo): the outer params and optimizer state
    #: (`xshard.reduce.periodic.OuterState`, `trainers.core.periodic`); None otherwise.
    outer: Any = None


class StepResult(NamedTuple):
    """One train step's result."""

    state: TrainState
    #: Scalars; the statistics-only ones are NaN below level 1 (`TrainStep.stats_keys`).
    metrics: dict[str, jax.Array]
    #: Per-layer statistics when a level >= 2 is served, else None.
    diag: dict[str, Any] | None


class TrainStep(NamedTuple):
    """`make_train_step`'s result: the step function and what its metrics mean."""

    fn: Callable[[TrainState, Any], StepResult]
    #: The metrics computed on statistics steps only (NaN below level 1); filled when `fn` is
    #: traced.
    stats_keys: set[str]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of the step (hashable; changing it means a new compilation)."""

    data_axes: tuple[str, ...]
    num_data_shards: int
    global_batch_size: int
    microbatches: int = 1
    grad_impl: str = "manual"
    seed: int = 0
    #: A periodic mesh axis whose replicas each run this step (`trainers.core.periodic`):
    #: folded into each shard's RNG, so shard i of the whole mesh draws as it would in a
    #: synchronous step; None: none.
    replica_axis: str | None = None


def step_rng(seed: int, step: jax.Array) -> jax.Array:
    """The step's RNG key: a pure function of (seed, step), so a resumed run draws the same."""
    return jax.random.fold_in(jax.random.key(seed), step)


def state_shardings(state: TrainState) -> Any:
    """The shardings of `state`'s arrays (what a step program keeps them in)."""
    return jax.tree.map(lambda x: x.sharding, state)


def placed_inputs(values: Mapping[str, float], mesh: Mesh) -> dict[str, jax.Array]:
    """`values` as float32 scalars on every device of `mesh`: a program's hyperparameter
    inputs, placed once per run (each process fills its own devices)."""
    replicated = NamedSharding(mesh, P())

    def place(value: float) -> jax.Array:
        return jax.make_array_from_callback((), replicated, lambda _: np.float32(value))

    return {key: place(value) for key, value in values.items()}
