"""Many small arrays of a state as one vector per dtype (`PackedLeaves`).

A jitted step that donates its state and returns the next one pays host time per buffer, on
every device, every step: dispatching it, and releasing the previous step's (~3.4 us a leaf
on 8 simulated CPU devices, docs/benchmarks.md, issue 38). A state's statistics and counters
are a dozen scalars and short vectors; packed, they are one buffer per dtype. Inside a traced
step, `PackedLeaves.unpack` slices them back out (XLA fuses the slices into their readers) and
`PackedLeaves.pack` concatenates the new values (one kernel per dtype). (A gradient packed for
its all-reduce is `xshard.mesh.collectives.psum_tree`'s, inside a step; this is a state at rest,
a pytree node that checkpoints and shardings see as its vectors.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one leaf lives: its vector, its offset there, its shape and dtype."""

    vector: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The static part of a `PackedLeaves`: the packed tree's structure and every leaf's slot.

    It is the pytree node's auxiliary data, so JAX compares it exactly (a jitted function is
    keyed on it): two layouts are equal only when every leaf has the same vector, offset,
    shape and dtype. (A state for other params, such as the one `optax.tree_map_params` builds
    from a placeholder, has another layout: map a state holding packed leaves with
    `tree_map_params`.)

    Attributes:
      treedef: the structure of the packed tree.
      slots: per leaf (in ``jax.tree.leaves`` order), its place in the vectors.
      dtypes: the vectors' dtypes (bool leaves are held as int32 0/1).
    """

    treedef: Any
    slots: tuple[_Slot, ...]
    dtypes: tuple[np.dtype, ...]


def _held_as(dtype: np.dtype) -> np.dtype:
    """The dtype of the vector that holds a leaf of `dtype`."""
    return np.dtype(np.int32) if dtype == np.bool_ else dtype


@jax.tree_util.register_pytree_with_keys_class
class PackedLeaves:
    """A pytree whose leaves are held as one vector per dtype (its only children).

    Build one with `pack` (inside or outside a traced function), read the tree back with
    `unpack`. Its children are named by dtype (``.float32``, ``.int32``) in checkpoints and
    tree paths. Vectors with leading batch dimensions (a vmapped state at rest) unpack to
    leaves with the same leading dimensions.
    """

    def __init__(self, vectors: tuple[Any, ...], layout: PackedLayout):
        self.vectors = tuple(vectors)
        self.layout = layout

    @classmethod
    def pack(cls, tree: Any) -> PackedLeaves:
        """`tree`'s leaves (arrays), one vector per dtype, in ``jax.tree.leaves`` order."""
        leaves, treedef = jax.tree.flatten(tree)
        dtypes: list[np.dtype] = []
        pieces: list[list[jax.Array]] = []
        slots = []
        for leaf in leaves:
            x = jnp.asarray(leaf)
            held = _held_as(np.dtype(x.dtype))
            if held not in dtypes:
                dtypes.append(held)
                pieces.append([])
            i = dtypes.index(held)
            offset = sum(int(p.size) for p in pieces[i])
            slots.append(_Slot(i, offset, tuple(x.shape), np.dtype(x.dtype)))
            pieces[i].append(jnp.ravel(x).astype(held))
        vectors = tuple(p[0] if len(p) == 1 else jnp.concatenate(p) for p in pieces)
        return cls(vectors, PackedLayout(treedef, tuple(slots), tuple(dtypes)))

    def unpack(self) -> Any:
        """The packed tree: each leaf sliced out of its vector (its shape and dtype again)."""
        leaves = []
        for slot in self.layout.slots:
            vector = self.vectors[slot.vector]
            size = math.prod(slot.shape)
            flat = jax.lax.slice_in_dim(vector, slot.offset, slot.offset + size, axis=-1)
            leaf = flat.reshape(vector.shape[:-1] + slot.shape)
            leaves.append(leaf if leaf.dtype == slot.dtype else leaf.astype(slot.dtype))
        return jax.tree.unflatten(self.layout.treedef, leaves)

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], PackedLayout]:
        keys = [jax.tree_util.GetAttrKey(d.name) for d in self.layout.dtypes]
        return list(zip(keys, self.vectors)), self.layout

    def tree_flatten(self) -> tuple[tuple[Any, ...], PackedLayout]:
        return self.vectors, self.layout

    @classmethod
    def tree_unflatten(cls, layout: PackedLayout, vectors: Any) -> PackedLeaves:
        return cls(tuple(vectors), layout)

    def __eq__(self, other: object) -> bool:
        """Equal layouts and vectors that compare equal, as a tuple's items (a tree of specs or
        shardings of a state compares as the unpacked records did)."""
        if not isinstance(other, PackedLeaves):
            return NotImplemented
        return self.layout == other.layout and self.vectors == other.vectors

    def __repr__(self) -> str:
        return f"PackedLeaves({', '.join(d.name for d in self.layout.dtypes)})"


def _is_packed(x: Any) -> bool:
    return isinstance(x, PackedLeaves)


def tree_map_params(
    initable: Callable[[Any], Any] | optax.GradientTransformation,
    f: Callable[..., Any],
    state: Any,
    /,
    *rest: Any,
    transform_non_params: Callable[..., Any] | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Any:
    """`optax.tree_map_params` for a state that holds `PackedLeaves` (`xshard.cross_shard`'s).

    optax matches `state` with the state `initable` builds for placeholder params, whose packed
    leaves have another layout (their per-leaf records are sized by the params). Here the
    packed leaves are non-param state: `transform_non_params` maps each of their vectors, and
    the result keeps `state`'s layouts (its structure). Arguments and result as optax's.
    """
    init = initable.init if isinstance(initable, optax.GradientTransformation) else initable
    non_params = transform_non_params or (lambda x: x)

    def placeholder_state(params: Any) -> Any:
        # Each packed node becomes its layout, a leaf (not a pytree), so that optax hands the
        # state's packed node there to `transform_non_params`, whole.
        return jax.tree.map(
            lambda x: x.layout if _is_packed(x) else x, init(params), is_leaf=_is_packed
        )

    def each_non_param(value: Any) -> Any:
        return jax.tree.map(non_params, value) if _is_packed(value) else non_params(value)

    return optax.tree_map_params(
        placeholder_state, f, state, *rest, transform_non_params=each_non_param, is_leaf=is_leaf
    )
