"""What the trace in context says about a reduction's mesh axes: whether they are manual here
(inside ``jax.shard_map`` or ``pmap``), whether the gradients are per shard over them, and how
many shards they hold; and the axes' names as a tuple (`axis_tuple`).

`xshard.reduce` reduces where this says the gradient lives: a gradient that is already invariant
over a manual axis was reduced before (`DoubleReductionError`), and per-shard clipping and
weighting need per-shard gradients (`PerShardGradientsRequired`). `xshard.cross_shard` asks the
same questions for its statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from xshard.config.reduction import axis_names
from xshard.mesh.vma import varying_axes

logger = logging.getLogger(__name__)

AxisNames = str | Sequence[str]


class PerShardGradientsRequired(ValueError):
    """Per-shard clipping or weighting was asked for gradients that were already reduced."""


class DoubleReductionError(ValueError):
    """Raised when gradients to reduce are already invariant over the reduction axis."""


def axis_tuple(axis_name: AxisNames) -> tuple[str, ...]:
    """`axis_name` as a tuple of distinct, non-empty axis names (`xshard.config.reduction`).

    Raises:
      ConfigError: for an empty name, an empty tuple or duplicates.
    """
    return axis_names(axis_name)


def axes_are_manual(axes: tuple[str, ...]) -> bool:
    """True if every axis in `axes` is manual here (shard_map or pmap); False if none is."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(() if mesh.empty else mesh.manual_axes)
    hits = [a for a in axes if a in manual]
    if hits and len(hits) != len(axes):
        raise ValueError(
            f"Reduction axes {axes!r} are only partly manual here (manual: {tuple(hits)!r}); "
            "put all of them, or none, in the shard_map's manual axes."
        )
    return bool(hits)


def tracks_varying(axes: tuple[str, ...]) -> bool:
    """Whether the current trace tracks varying-ness (shard_map with check_vma=True).

    Under `pmap` or `shard_map(check_vma=False)` nothing is marked varying, and the gradient of
    replicated params is per shard already, so there is nothing to check.
    """
    probe = jax.lax.pcast(jnp.zeros((), jnp.int32), axes, to="varying")
    return bool(set(axes) & varying_axes(probe))


def check_per_shard(grads: Any, axes: tuple[str, ...]) -> None:
    """Refuses a gradient already reduced over a manual axis of `axes` (JAX types it invariant
    there): reducing it again would count every shard N times.

    Raises:
      DoubleReductionError: naming the leaf and the axes, with the fix.
    """
    if not tracks_varying(axes):
        return
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        missing = [a for a in axes if a not in varying_axes(g)]
        if missing:
            raise DoubleReductionError(
                f"Gradient leaf {jax.tree_util.keystr(path) or '<root>'} is already invariant over "
                f"mesh axes {tuple(missing)!r}: it was reduced before reaching cross_shard, and "
                "reducing it again would count every shard's contribution N times. Inside "
                "shard_map, jax.grad of a loss w.r.t. replicated params is already summed over "
                "the manual axes. Take per-shard gradients instead: "
                f"params = jax.lax.pcast(params, {axes!r}, to='varying') before jax.grad."
            )


def require_per_shard(grads: Any, axes: tuple[str, ...], what: str) -> None:
    """Per-shard clipping and weighting need per-shard gradients: inside shard_map, varying."""
    if not axes_are_manual(axes):
        raise PerShardGradientsRequired(
            f"{what}: needs per-shard gradients, computed inside jax.shard_map with mesh axes "
            f"{axes!r} manual; these gradients were computed outside it (plain jit / GSPMD), "
            "where no per-shard gradient exists."
        )
    check_per_shard(grads, axes)


def shards_in_context(axes: tuple[str, ...], num_shards: int | None) -> int:
    """The number of shards over `axes`: `num_shards` if given, else from the mesh in context
    (1, with a warning, where there is none).

    Raises:
      ValueError: for an axis the mesh in context lacks.
    """
    if num_shards is not None:
        return num_shards
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        logger.warning(
            "cross_shard(reduction='sum') runs outside shard_map with no mesh in context "
            "(jax.set_mesh) and no num_shards=: assuming 1 shard."
        )
        return 1
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise ValueError(
            f"Reduction axis_name {tuple(unknown)!r} is not an axis of the mesh in context "
            f"(axes: {tuple(mesh.axis_names)!r})."
        )
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n
