"""Muon's momentum in owner order: each matrix whole on one device while its rows stay sliced.

At ``sharding.zero_stage=3`` the params and Muon's momentum are sliced by rows over the N
devices, and the Newton-Schulz iterations need each matrix whole on one device (its owner,
`xshard.optim.muon.owned`). With the momentum laid out by rows, the owner receives the
(N-1)/N of it the others hold (an all-to-all) and sends the update back (another). Owner
order keeps the momentum's tree, shapes and shardings and swaps blocks of rows instead: the
matrices of one shape are taken N at a time (a *group*, in the params' tree order), each split
in N blocks of rows, and the leaf of matrix j holds, as its block k, block j of matrix k:

    stored[j][block k] = true[k][block j]    (a swap of two indices: its own inverse)

Sliced by rows (block k on device k, a plain `jax.sharding.NamedSharding`), device k then holds
every block of matrix k: the whole matrix, with no communication. A gradient swapped the same
way before its reduce-scatter (local: each shard holds its whole gradient) arrives at its owner
whole, for the same bytes as the row reduce-scatter; only the update goes back to the rows of
the params (one all-to-all). Matrices outside a full group (fewer than N of a shape), or whose
rows do not divide by N, keep the row order. Checkpoints hold the row order (`swap_state`, at
save and at restore): owner order depends on N, which a restore may change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.transforms import MaskedNode


def _is_masked(x: Any) -> bool:
    return isinstance(x, MaskedNode)


def _is_muon_state(x: Any) -> bool:
    return isinstance(x, MuonState)


def _is_dims(x: Any) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def owner_groups(mu: Any, n: int) -> list[list[int]]:
    """The groups laid out in owner order, as indices into the leaves of a tree shaped like
    `mu` (an `optax.transforms.MaskedNode` counted as one leaf, as in the params' tree).

    Args:
      mu: a Muon momentum (`optax.contrib.MuonState.mu`): arrays or shape structs, and
        `MaskedNode` where Muon's Adam fallback updates.
      n: N, the number of devices the rows are sliced over (0 or 1: no groups).

    Returns:
      Per (shape, dtype) of the momenta whose first dimension divides by `n`, in tree order,
      each run of `n` of them (a last, partial run is left out).
    """
    if n <= 1:
        return []
    by_kind: dict[Any, list[int]] = {}
    for i, x in enumerate(jax.tree.leaves(mu, is_leaf=_is_masked)):
        if not _is_masked(x) and len(x.shape) >= 1 and x.shape[0] % n == 0:
            by_kind.setdefault((tuple(x.shape), x.dtype), []).append(i)
    return [
        members[start : start + n]
        for members in by_kind.values()
        for start in range(0, len(members) - len(members) % n, n)
    ]


def swap_blocks(stack: jax.Array) -> jax.Array:
    """An (N, r, ...) stack of N matrices with block k of row j moved to block j of row k
    (blocks of r/N rows): from owner order to the matrices whole, and back."""
    n, r = stack.shape[0], stack.shape[1]
    blocks = stack.reshape(n, n, r // n, *stack.shape[2:])
    return jnp.swapaxes(blocks, 0, 1).reshape(stack.shape)


def swap_order(tree: Any, groups: list[list[int]]) -> Any:
    """`tree` (shaped like the params; `MaskedNode` a leaf) with each group's leaves swapped
    between row order and owner order (`swap_blocks`)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
    for group in groups:
        swapped = swap_blocks(jnp.stack([leaves[i] for i in group]))
        for k, i in enumerate(group):
            leaves[i] = swapped[k].astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, leaves)


def muon_groups(opt_state: Any, n: int) -> list[list[int]] | None:
    """`owner_groups` of the Muon momentum `opt_state` holds (any nesting), or None if it
    holds none (several Muon states: those of the first; they share the params' tree)."""
    for s in jax.tree.leaves(opt_state, is_leaf=_is_muon_state):
        if isinstance(s, MuonState):
            return owner_groups(s.mu, n)
    return None


def swap_state(opt_state: Any, n: int) -> Any:
    """`opt_state` with every Muon momentum swapped between row order and owner order over
    `n` devices (`swap_order`): what a checkpoint saves and restores at stage 3."""

    def swap(s: Any) -> Any:
        if not isinstance(s, MuonState):
            return s
        return s._replace(mu=swap_order(s.mu, owner_groups(s.mu, n)))

    return jax.tree.map(swap, opt_state, is_leaf=_is_muon_state)


def mesh_size() -> int:
    """The number of devices of the mesh in context; 0 without one or inside a manual
    ``shard_map`` (where `owned` orthogonalises every matrix whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 0 if mesh.empty or mesh.manual_axes else mesh.size


def whole(x: jax.Array) -> jax.Array:
    """`x` laid out whole on every device of the mesh in context (``jax.set_mesh``), so its
    consumers compute on the whole array; unchanged without a mesh, or inside a ``shard_map``
    manual over every axis (where each device holds its own value)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.manual_axes) == set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, P())


def _to_owners(stack: jax.Array) -> jax.Array:
    """`swap_blocks` of a group's stack in owner order, rows sliced over the devices of the
    mesh in context: each device's blocks are its matrix whole, so in a ``shard_map`` (GSPMD
    alone moved them by all-to-alls) the swap is a reshape of each device's slice."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh_size():
        return swap_blocks(stack)
    axes = tuple(mesh.axis_names)
    return jax.shard_map(
        lambda local: local.reshape(1, -1, *local.shape[2:]),
        in_specs=P(None, axes),
        out_specs=P(axes),
        axis_names=set(axes),
    )(stack)


def to_owner_order(updates: Any, groups: list[list[int]]) -> Any:
    """`updates` in row order with `groups` swapped to owner order (`swap_order`): under a mesh
    one all-to-all per group (each device sends block j of its rows to device j), in a
    ``shard_map`` (GSPMD alone moved each matrix by all-to-alls of its own)."""
    if not mesh_size() or not groups:
        return swap_order(updates, groups)
    axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
    exchange = jax.shard_map(
        lambda local: jax.lax.all_to_all(local, axes, 0, 0, tiled=True),
        in_specs=P(None, axes),
        out_specs=P(None, axes),
        axis_names=set(axes),
    )
    leaves, treedef = jax.tree.flatten(updates, is_leaf=_is_masked)
    for group in groups:
        swapped = exchange(jnp.stack([leaves[i] for i in group]))
        for k, i in enumerate(group):
            leaves[i] = swapped[k]
    return jax.tree.unflatten(treedef, leaves)


def owned(
    orthogonalize: Callable[..., jax.Array], mu_hat: Any, dims: Any, groups: list[list[int]]
) -> Any:
    """Each matrix of `mu_hat` in `groups` (`xshard.optim.muon_owners.owner_groups`: in owner
    order, the momentum of ``zero_stage=3``) orthogonalised whole by one device, its owner:
    the group, stacked, is swapped to its matrices whole (`swap_blocks`: no communication
    where the rows are sliced over the N devices), orthogonalised there (vmapped) and left in
    that layout, which the consumer's (the row slices of the params) takes back with one
    all-to-all. The other matrices are orthogonalised whole (`whole_each`).

    Raises:
      ValueError: if the matrices of a group have different dimension numbers.
    """
    leaves, treedef = jax.tree.flatten(mu_hat, is_leaf=_is_masked)
    dims_leaves = treedef.flatten_up_to(dims)  # type: ignore[attr-defined]  # jaxlib: no stubs
    out = list(leaves)
    for group in groups:
        d = dims_leaves[group[0]]
        if any(dims_leaves[i] != d for i in group):
            raise ValueError(f"Muon's matrices of one shape differ in dimensions: {d}.")
        stack = _to_owners(jnp.stack([leaves[i] for i in group]))
        done = jax.vmap(lambda x, d=d: orthogonalize(x, dimension_numbers=d))(stack)
        if mesh_size():  # left with its owners: the consumer's layout takes it from there
            mesh = jax.sharding.get_abstract_mesh()
            done = jax.lax.with_sharding_constraint(done, P(tuple(mesh.axis_names)))
        for k, i in enumerate(group):
            out[i] = done[k]
    grouped = {i for group in groups for i in group}
    rest = [i for i, d in enumerate(dims_leaves) if _is_dims(d) and i not in grouped]
    for i in rest:
        out[i] = whole(orthogonalize(whole(leaves[i]), dimension_numbers=dims_leaves[i]))
    return jax.tree.unflatten(treedef, out)
