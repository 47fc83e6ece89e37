"""Logical axis names of a model's parameters mapped to mesh axes by rules from the config.

Flax models name the dimensions of their parameters (``nnx.with_partitioning(init, ("embed",
"mlp"))``, ``nn.with_logical_partitioning(init, ("embed", "mlp"))``); the config maps those
*logical* names to mesh axes, as MaxText and Flax do::

    task:
      logical_axis_rules: {embed: null, mlp: model, heads: model, vocab: model}

A rule's value is a mesh axis, a list of mesh axes (the dimension is split over their
product), or null (not split). Every name a model uses needs a rule; mesh axes the mesh does not
have are dropped when the specs are applied (`trainers.tasks.sharding.restrict_spec`), so one
set of rules serves ``mesh=cpu8`` and ``mesh=cpu4x2``. Parameters without names are replicated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from xshard.errors import ConfigError

#: Config key of the rules, for error messages.
RULES_KEY = "task.logical_axis_rules"

LogicalRules = dict[str, tuple[str, ...]]


def check_logical_rules(rules: Mapping[str, Any] | None) -> LogicalRules:
    """Returns the rules as ``{logical name: (mesh axes...)}`` (``()``: not split).

    Args:
      rules: the config's ``task.logical_axis_rules``: a mapping from logical names to a mesh
        axis, a list of mesh axes, or null; None for no rules.

    Raises:
      ConfigError: naming the key and the value, for anything else.
    """
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise ConfigError(
            f"{RULES_KEY}={rules!r}: expected a mapping from logical axis names to a mesh "
            "axis, a list of mesh axes or null, e.g. {embed: null, mlp: model}."
        )
    out: LogicalRules = {}
    for name, value in rules.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{RULES_KEY}: the key {name!r} is not a logical axis name.")
        axes = (
            ()
            if value is None
            else (value,)
            if isinstance(value, str)
            else tuple(value)
            if isinstance(value, Sequence)
            else None
        )
        if axes is None or not all(isinstance(a, str) and a for a in axes):
            raise ConfigError(
                f"{RULES_KEY}.{name}={value!r}: expected a mesh axis name, a list of them, or "
                "null (not split)."
            )
        out[name] = axes
    return out


def logical_spec(
    names: Sequence[Any], rules: LogicalRules, path: str, known: Sequence[str] = ()
) -> PartitionSpec:
    """The PartitionSpec of a parameter whose dimensions have the logical `names`.

    Args:
      names: one entry per dimension: a logical name, a tuple of them, or None (not split).
      rules: the checked rules (`check_logical_rules`).
      path: the parameter's path, for error messages.
      known: every logical name the model uses, listed in the error message.

    Returns:
      A PartitionSpec over mesh axes.

    Raises:
      ConfigError: for a name without a rule (listing the rules' names and the model's), or
        rules that put one mesh axis on two dimensions of the parameter.
    """
    entries: list[Any] = []
    used: dict[str, Any] = {}
    for entry in names:
        parts = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        axes: list[str] = []
        for name in parts:
            if name not in rules:
                raise ConfigError(
                    f"{RULES_KEY} has no rule for the logical axis {name!r} of parameter "
                    f"{path!r}. Known logical axes: rules for {sorted(rules)}; the model uses "
                    f"{sorted(set(known) | {name})}. Add e.g. '{RULES_KEY}.{name}=null' (not "
                    "split) or a mesh axis."
                )
            for axis in rules[name]:
                if axis in used and used[axis] != entry:
                    raise ConfigError(
                        f"{RULES_KEY} maps logical axes {used[axis]!r} and {entry!r} of "
                        f"parameter {path!r} to the same mesh axis {axis!r}; a mesh axis can "
                        "split one dimension only."
                    )
                used[axis] = entry
                if axis not in axes:
                    axes.append(axis)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def exact_path_rules(specs: Mapping[str, PartitionSpec]) -> list[tuple[str, PartitionSpec]]:
    """``(regex, spec)`` rules that match each path of `specs` exactly, for `param_specs`."""
    return [(re.escape(path), spec) for path, spec in specs.items()]


def names_in(annotations: Mapping[str, Sequence[Any]]) -> list[str]:
    """Every logical name used by `annotations` (``{path: names}``), sorted."""
    found: set[str] = set()
    for names in annotations.values():
        for entry in names:
            if isinstance(entry, str):
                found.add(entry)
            elif entry is not None:
                found.update(entry)
    return sorted(found)


def specs_from_annotations(
    annotations: Mapping[str, Sequence[Any]], rules: LogicalRules
) -> dict[str, PartitionSpec]:
    """``{path: PartitionSpec}`` for every annotated parameter (`logical_spec` each).

    Raises:
      ConfigError: as `logical_spec`.
    """
    known = names_in(annotations)
    return {path: logical_spec(names, rules, path, known) for path, names in annotations.items()}
