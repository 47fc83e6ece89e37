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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one leaf lives: its vector, its offset there, its shape and dtype."""

    vector: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True, eq=False)
class PackedLayout:
    """The static part of a `PackedLeaves`: the packed tree's structure and every leaf's slot.

    Two layouts are equal (the same pytree structure) when their trees have the same
    structure, leaf dtypes and ranks, whatever the leaves' sizes, as two arrays of one rank
    have one structure: so `optax.tree_map_params`, which matches the state of placeholder
    params with the real one, maps a packed state (its per-leaf vectors have another length
    there). The sizes are the vectors' shapes, which a jitted function is keyed on.

    Attributes:
      treedef: the structure of the packed tree.
      slots: per leaf (in ``jax.tree.leaves`` order), its place in the vectors.
      dtypes: the vectors' dtypes (bool leaves are held as int32 0/1).
    """

    treedef: Any
    slots: tuple[_Slot, ...]
    dtypes: tuple[np.dtype, ...]

    def _structure(self) -> tuple[Any, ...]:
        ranks = tuple((s.vector, len(s.shape), s.dtype) for s in self.slots)
        return (self.treedef, self.dtypes, ranks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedLayout) and self._structure() == other._structure()

    def __hash__(self) -> int:
        return hash(self._structure())


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

    def __repr__(self) -> str:
        return f"PackedLeaves({', '.join(d.name for d in self.layout.dtypes)})"
