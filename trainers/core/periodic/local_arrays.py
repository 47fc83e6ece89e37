"""What one process of a replica group holds of its arrays, and the arrays rebuilt from it.

A replica group may be several ``jax.distributed`` processes; its arrays then span them and no
process can read one whole (`jax.device_get` refuses). An elastic sync works on each process's
part (`trainers.core.periodic.group_sync`): torchft pairs rank r of every group, and groups that
run the same config on the same mesh hold the same parts in the same rank, so rank r's parts
are all rank r of another group needs.

- `LocalParts`: an array's addressable shards (each distinct index once), as host arrays, and
  `local_parts` / `from_local_parts` between them and a (global) array;
- `vector_sharding`, `local_vector`, `global_vector`: a float32 vector split over every device
  of the mesh, this process's contiguous piece of it, and the vector rebuilt from that piece.

In a group of one process every part is the whole array, and the same code runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: A shard's place in its array: (start, stop) per dimension.
Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class LocalParts:
    """The parts of one array that this process holds (a pytree leaf, picklable)."""

    shape: tuple[int, ...]
    dtype: str
    parts: dict[Index, np.ndarray]


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def local_parts(tree: Any) -> Any:
    """`tree` with each array replaced by the `LocalParts` this process holds of it."""

    def parts(x: jax.Array) -> LocalParts:
        held = {_index(s.index, x.shape): s for s in x.addressable_shards}
        host = jax.device_get([s.data for s in held.values()])
        return LocalParts(tuple(x.shape), np.dtype(x.dtype).name, dict(zip(held, host)))

    return jax.tree.map(parts, tree)


def from_local_parts(tree: Any, shardings: Any) -> Any:
    """The arrays of `tree` (of `LocalParts`, another process's of the same rank) placed with
    `shardings` (the same layout: each addressable device's index among the parts)."""

    def build(held: LocalParts, sharding: jax.sharding.Sharding) -> jax.Array:
        return jax.make_array_from_callback(
            held.shape, sharding, lambda index: held.parts[_index(tuple(index or ()), held.shape)]
        )

    return jax.tree.map(build, tree, shardings)


def layout(tree: Any) -> Any:
    """What must match for `from_local_parts`: each leaf's shape, dtype and the indices of
    its parts, for a tree of `LocalParts` or of arrays (the parts this process holds)."""

    def one(x: Any) -> tuple[tuple[int, ...], str, list[Index]]:
        if isinstance(x, LocalParts):
            return x.shape, x.dtype, sorted(x.parts)
        held = {_index(s.index, x.shape) for s in x.addressable_shards}
        return tuple(x.shape), np.dtype(x.dtype).name, sorted(held)

    return jax.tree.map(one, tree)


def vector_sharding(mesh: Mesh) -> NamedSharding:
    """A vector split evenly over every device of `mesh` (its axes flattened)."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def padded_size(size: int, mesh: Mesh) -> int:
    """`size` rounded up to a multiple of the mesh's device count."""
    return math.ceil(size / mesh.size) * mesh.size


def local_vector(x: jax.Array) -> np.ndarray:
    """This process's piece of a vector placed with `vector_sharding` (one contiguous run)."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].indices(x.shape[0])[0])
    host = jax.device_get([s.data for s in shards])
    return np.concatenate(host)


def global_vector(local: np.ndarray, mesh: Mesh, size: int) -> jax.Array:
    """The vector of `size` whose piece in this process is `local` (`local_vector`'s)."""
    return jax.make_array_from_process_local_data(vector_sharding(mesh), local, (size,))
