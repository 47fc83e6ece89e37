"""Sharding helpers for tasks: parameter PartitionSpecs from regex rules, process batch slices.

Parameter rules are `(regex, PartitionSpec)` pairs matched against parameter paths, the keys of
the nested param dicts joined with "/" (e.g. "blocks/0/attn/wq"). Matching uses `re.fullmatch`:
a rule describes the whole path, so "layers/.*/w" matches "layers/0/w" but not "layers/0/wo".
The first rule that matches wins; unmatched parameters are replicated (`P()`).

The same task must run on meshes with and without model axes, so mesh axes named in a rule but
absent from the mesh are dropped (replaced by None): `P(None, "model")` becomes `P(None, None)`
on an 8-way `("data",)` mesh.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xshard.stats.tree import path_str

Rules = Sequence[tuple[str, PartitionSpec]]


# --------------------------------------------------------------------------------------------
# Parameter partition specs.
# --------------------------------------------------------------------------------------------


def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names in one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return ()  # e.g. PartitionSpec.UNCONSTRAINED


def restrict_spec(spec: PartitionSpec, mesh_axis_names: Sequence[str]) -> PartitionSpec:
    """Replaces the axes of `spec` that are not in `mesh_axis_names` by None.

    Args:
      spec: a PartitionSpec, e.g. `P(None, "model")` or `P(("data", "model"))`.
      mesh_axis_names: the axes of the mesh the params will live on.

    Returns:
      The spec over the mesh's axes only; entries left with no axis become None.
    """
    names = set(mesh_axis_names)
    entries = []
    for entry in spec:
        if entry is None or isinstance(entry, (str, tuple, list)):
            kept = tuple(a for a in _entry_axes(entry) if a in names)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        else:
            entries.append(entry)
    return PartitionSpec(*entries)


def _validate(
    path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh_shape: Mapping[str, int]
) -> None:
    """Raises ValueError if `spec` does not fit a parameter of `shape` on `mesh_shape`."""
    if len(spec) > len(shape):
        raise ValueError(
            f"sharding rule for parameter {path!r} has spec {spec} with {len(spec)} entries, "
            f"but the parameter has shape {shape} ({len(shape)} dims)"
        )
    for dim, entry in zip(shape, spec):
        axes = _entry_axes(entry)
        size = int(np.prod([mesh_shape[a] for a in axes if a in mesh_shape], dtype=np.int64))
        if dim % size:
            raise ValueError(
                f"parameter {path!r} of shape {shape} cannot be sharded with spec {spec}: "
                f"dimension {dim} is not divisible by mesh axis size {size} of {axes} "
                f"(mesh shape {dict(mesh_shape)})"
            )


def spec_for(path: str, rules: Rules) -> PartitionSpec:
    """Returns the spec of the first rule whose regex fully matches `path`, else `P()`."""
    for pattern, spec in rules:
        if re.fullmatch(pattern, path):
            return spec
    return PartitionSpec()


def param_specs(
    params: Any,
    rules: Rules,
    mesh_axis_names: Sequence[str],
    mesh_shape: Mapping[str, int] | None = None,
) -> Any:
    """Maps each parameter to the PartitionSpec its first matching rule gives.

    Args:
      params: a pytree of arrays, or of anything with a `.shape` (e.g. the
        `jax.ShapeDtypeStruct`s from `jax.eval_shape(task.init, ...)`).
      rules: `(regex, PartitionSpec)` pairs; `re.fullmatch` on the "/"-joined path, first match
        wins, unmatched parameters are replicated.
      mesh_axis_names: the mesh's axis names; axes of a spec not among them are dropped.
      mesh_shape: optional `{axis name: size}` (e.g. `dict(mesh.shape)`); when given, every
        sharded dimension is checked to be divisible by its mesh axis size.

    Returns:
      A pytree of PartitionSpecs with the structure of `params`.

    Raises:
      ValueError: a spec has more entries than its parameter has dimensions, or (with
        `mesh_shape`) a sharded dimension is not divisible by the mesh axis size; the message
        names the parameter path, its shape, the spec and the mesh axis size.
    """

    def one(path, leaf):
        name = path_str(path)
        spec = restrict_spec(spec_for(name, rules), mesh_axis_names)
        _validate(name, tuple(np.shape(leaf)), spec, mesh_shape or {})
        return spec

    return jax.tree_util.tree_map_with_path(one, params)


def param_shardings(params: Any, rules: Rules, mesh: Mesh) -> Any:
    """Like `param_specs`, validated against `mesh`, with each spec wrapped in a NamedSharding.

    Args:
      params: a pytree of arrays or shape structs.
      rules: `(regex, PartitionSpec)` pairs, as in `param_specs`.
      mesh: the device mesh.

    Returns:
      A pytree of `NamedSharding(mesh, spec)` with the structure of `params`.
    """
    specs = param_specs(params, rules, mesh.axis_names, dict(mesh.shape))
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


# --------------------------------------------------------------------------------------------
# Process slices of the global batch.
# --------------------------------------------------------------------------------------------
