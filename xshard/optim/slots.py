"""Read the inner optimizer's per-parameter state, as TF's `Optimizer.get_slot` did.

A *slot* is a field of an optax state that holds one value per parameter, with the same tree
structure as the params: adam's ``mu`` and ``nu``, momentum's ``trace``. Unlike TF, which
returned one variable's slot, `get_slot` returns the whole pytree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import optax

from xshard.optim.cross_shard import CrossShardState

# Fields of optax states that hold scalars or hyperparameters, never per-parameter values.
_NOT_SLOTS = frozenset(
    {
        "count",
        "hyperparams",
        "hyperparams_states",
        "notfinite_count",
        "last_finite",
        "total_notfinite",
        "mini_step",
        "gradient_step",
    }
)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _named_fields(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yields (field name, value) of every NamedTuple state in `tree`, depth first."""
    if _is_namedtuple(tree):
        for name, value in zip(tree._fields, tree):
            yield name, value
            yield from _named_fields(value)
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            yield from _named_fields(value)
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _named_fields(value)


def _contains_state(tree: Any) -> bool:
    return any(_is_namedtuple(x) for x in jax.tree.leaves(tree, is_leaf=_is_namedtuple))


def _is_slot(name: str, value: Any) -> bool:
    if name in _NOT_SLOTS or _contains_state(value):
        return False
    leaves = jax.tree.leaves(value)
    if not leaves:
        return False
    return not (len(leaves) == 1 and value is leaves[0] and getattr(value, "ndim", 0) == 0)


def cross_shard_state(state: optax.OptState) -> CrossShardState:
    """Returns the first `cross_shard` state in `state` (itself, or inside a chain).

    Raises:
      ValueError: if `state` holds no `cross_shard` state.
    """
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CrossShardState)):
        if isinstance(x, CrossShardState):
            return x
    raise ValueError(f"No cross_shard state found in a {type(state).__name__}.")


def has_cross_shard_state(state: optax.OptState) -> bool:
    """Whether `state` is, or holds, a `cross_shard` state."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CrossShardState))
    return any(isinstance(x, CrossShardState) for x in leaves)


def find_states(state: optax.OptState, kind: type) -> list[Any]:
    """Every sub-state of type `kind` in `state`, depth first (e.g. the recorded clip's)."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
    return [x for x in leaves if isinstance(x, kind)]


def inner_state(state: optax.OptState) -> optax.OptState:
    """Returns the inner optimizer's state from a `cross_shard` state (or a tree holding one).

    Raises:
      ValueError: if `state` holds no `cross_shard` state.
    """
    return cross_shard_state(state).inner_state


def get_slot_names(state: optax.OptState) -> list[str]:
    """Returns the names of the inner optimizer's slots, e.g. ``["mu", "nu"]`` for adam."""
    names: list[str] = []
    for name, value in _named_fields(inner_state(state)):
        if name not in names and _is_slot(name, value):
            names.append(name)
    return names


def get_slot(state: optax.OptState, name: str) -> Any:
    """Returns the slot `name` (a pytree shaped like the params), or None if there is none.

    When several inner transforms have a slot of that name (a chain of two momentums), the
    first one in the chain is returned.
    """
    found = optax.tree.get_all_with_path(
        inner_state(state), name, filtering=lambda _, value: _is_slot(name, value)
    )
    return found[0][1] if found else None


def get_hyperparams(state: optax.OptState) -> dict[str, Any]:
    """Returns the current hyperparameters of the first `optax.inject_hyperparams` inside.

    With a schedule, ``get_hyperparams(state)["learning_rate"]`` is the rate of the last
    update. Returns an empty dict when no inner transform injects hyperparameters. `state` is
    a `cross_shard` state (or a tree holding one: its inner optimizer is searched) or the
    state of any optax optimizer.
    """
    searched = inner_state(state) if has_cross_shard_state(state) else state
    found = optax.tree.get_all_with_path(
        searched, "hyperparams", filtering=lambda _, value: isinstance(value, dict)
    )
    return found[0][1] if found else {}
