"""Model state: the variables of a model that change during training but are not trained.

BatchNorm statistics, RNG counters and the like live in `TrainState.model_state`, next to the
params. A *stateful* task (the Flax tasks) implements, instead of ``init`` and ``loss``::

    init_with_state(rng, batch) -> (params, model_state)
    loss_with_state(params, model_state, batch, rng) -> (loss, aux, new_model_state)

A plain task (``init``/``loss``) has the empty model state ``{}``; the step treats both the same
way through `init_fn` and `loss_fn`. After each step the new model state is made identical on
every data shard (`reduce_over_shards`): floating-point values that differ between shards are
averaged over them (cross-replica statistics), others must not differ.

Checkpoints of a state without model state keep the layout they had before model state existed
(`saved_tree`), so older checkpoints restore and newer ones read the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp

from trainers.tasks.base import StatefulTask, Task
from xshard.mesh.vma import varying_axes

ModelState = Any
InitFn = Callable[[jax.Array, Any], tuple[Any, ModelState]]
LossFn = Callable[[Any, ModelState, Any, jax.Array], tuple[jax.Array, dict, ModelState]]


def is_stateful(task: Task) -> TypeGuard[StatefulTask]:
    """Whether `task` carries model state (it has ``init_with_state`` and ``loss_with_state``)."""
    return callable(getattr(task, "loss_with_state", None)) and callable(
        getattr(task, "init_with_state", None)
    )


def init_fn(task: Task) -> InitFn:
    """``(rng, batch) -> (params, model_state)`` for any task (``{}`` for a plain one)."""
    if is_stateful(task):
        return task.init_with_state
    return lambda rng, batch: (task.init(rng, batch), {})


def loss_fn(task: Task) -> LossFn:
    """``(params, model_state, batch, rng) -> (loss, aux, model_state)`` for any task."""
    if is_stateful(task):
        return task.loss_with_state

    def plain(params, model_state, batch, rng):
        loss, aux = task.loss(params, batch, rng)
        return loss, aux, model_state

    return plain


def reduce_over_shards(model_state: ModelState, axes: Sequence[str]) -> ModelState:
    """Makes a new model state identical on every data shard (inside the manual step).

    A floating-point leaf that varies over the data `axes` (per-shard BatchNorm statistics of
    a model without cross-replica BatchNorm) is averaged over them: for a running mean that is
    the mean of the global batch. A leaf that does not vary (computed from replicated inputs
    or with cross-replica statistics) is left as it is.

    Raises:
      ValueError: for a leaf of another dtype (an integer counter, a key) that varies: there
        is no meaningful average of it; the model should not make it depend on the shard.
    """
    axes = tuple(axes)

    def one(path, x):
        varying = tuple(a for a in axes if a in varying_axes(x))
        if not varying:
            return x
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, varying)
        raise ValueError(
            f"model state {jax.tree_util.keystr(path)} ({x.dtype}) differs between data shards; "
            "only floating-point model state can be averaged over them."
        )

    return jax.tree_util.tree_map_with_path(one, model_state)


class _SavedState(NamedTuple):
    """The checkpoint layout of a state without model state: `TrainState` before it had one."""

    step: jax.Array
    params: Any
    opt_state: Any


def saved_tree(state: Any) -> Any:
    """What a checkpoint holds for `state`: the state, without an empty ``model_state`` (and
    without ``outer`` where there is none)."""
    if jax.tree.leaves(state.model_state) or getattr(state, "outer", None) is not None:
        return state
    return _SavedState(state.step, state.params, state.opt_state)


def from_saved(saved: Any, like: Any) -> Any:
    """The `TrainState` for a restored `saved_tree` (`like`: a state of the run)."""
    if isinstance(saved, _SavedState):
        return type(like)(saved.step, saved.params, saved.opt_state, like.model_state)
    return saved
