"""Mesh config nodes: parsing, static validation and axis-size resolution (no devices needed).

See `xshard.mesh` for the node's keys and for building the mesh. Everything here is pure
Python: `mesh_shape(cfg, num_devices)` tells the shape a config will have on a machine of that
size without initialising JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import AxisType
from omegaconf import DictConfig, OmegaConf

from xshard.errors import ConfigError

KEY = "mesh"  # where the node lives in the primary config; used in error messages
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
_KNOWN_KEYS = (
    "name",
    "topology",
    "num_devices",
    "axes",
    "ici",
    "dcn",
    "axis_types",
    "simulate_on_cpu",
    "data_axes",
)


class MeshConfigError(ConfigError):
    """A mesh config that is invalid or cannot be built on the devices present (a ValueError)."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A parsed and statically validated mesh config node (see the module docstring).

    ``ici`` and ``dcn`` may still hold one ``-1`` each; `resolve_axis_sizes` fills them in
    once the number of devices is known.
    """

    axes: tuple[str, ...]
    ici: tuple[int, ...]
    dcn: tuple[int, ...]
    data_axes: tuple[str, ...]
    axis_types: tuple[AxisType, ...]
    num_devices: int | None = None
    simulate_on_cpu: bool = False
    name: str | None = None


# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------


def _to_dict(cfg_mesh: Any) -> dict[str, Any]:
    """Returns a plain dict for a DictConfig, a mapping, a dataclass or None."""
    if cfg_mesh is None:
        return {}
    if isinstance(cfg_mesh, DictConfig):
        return OmegaConf.to_container(cfg_mesh, resolve=True)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg_mesh) and not isinstance(cfg_mesh, type):
        return dataclasses.asdict(cfg_mesh)
    if isinstance(cfg_mesh, Mapping):
        return dict(cfg_mesh)
    raise MeshConfigError(
        f"{KEY}: expected a mapping (DictConfig or dict), got {type(cfg_mesh).__name__}"
    )


def _names(value: Any, key: str, null: str = "") -> tuple[str, ...]:
    """Parses a list of axis names (a single string counts as one name); `null` says what
    null means, for the error message. An empty list is refused, not taken for null: it would
    silently mean the default."""
    allowed = f"a non-empty list of axis names, e.g. [data] or [data, model]{null}"
    if not isinstance(value, str | Sequence):
        raise MeshConfigError(f"{KEY}.{key}={value!r}: expected {allowed}")
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise MeshConfigError(f"{KEY}.{key}={list(names)}: expected {allowed}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise MeshConfigError(
            f"{KEY}.{key}={list(names)}: duplicate axis names {dups}; each axis needs its own name"
        )
    return names


def _sizes(value: Any, key: str, axes: tuple[str, ...]) -> tuple[int, ...]:
    """Parses one group of per-axis sizes (positive ints, at most one -1)."""
    if not isinstance(value, int | Sequence) or isinstance(value, str):
        raise MeshConfigError(f"{KEY}.{key}={value!r}: expected a list of sizes, one per axis")
    sizes = (value,) if isinstance(value, int) else tuple(value)
    if any(isinstance(s, bool) or not isinstance(s, int) or (s < 1 and s != -1) for s in sizes):
        raise MeshConfigError(
            f"{KEY}.{key}={list(sizes)}: sizes must be positive integers or -1 (the remaining "
            "devices)"
        )
    if len(sizes) != len(axes):
        raise MeshConfigError(
            f"{KEY}.{key}={list(sizes)} has {len(sizes)} entries but {KEY}.axes={list(axes)} "
            f"has {len(axes)}: give one size per axis"
        )
    if sizes.count(-1) > 1:
        raise MeshConfigError(
            f"{KEY}.{key}={list(sizes)}: at most one -1 per group (it means 'the remaining "
            "devices'); give explicit sizes for the other axes"
        )
    return sizes


def _axis_types(value: Any, axes: tuple[str, ...]) -> tuple[AxisType, ...]:
    """Parses ``axis_types``: "auto"/"explicit" for all axes, or one per axis."""
    values = [value] * len(axes) if isinstance(value, str | AxisType) else list(value)
    if len(values) != len(axes):
        raise MeshConfigError(
            f"{KEY}.axis_types={values} has {len(values)} entries but {KEY}.axes={list(axes)} "
            f"has {len(axes)}"
        )
    out: list[AxisType] = []
    for v in values:
        if isinstance(v, AxisType) and v != AxisType.Manual:
            out.append(v)
        elif isinstance(v, str) and v.strip().lower() in _AXIS_TYPES:
            out.append(_AXIS_TYPES[v.strip().lower()])
        else:
            raise MeshConfigError(
                f"{KEY}.axis_types={value!r}: unsupported value {v!r}. Allowed: "
                f"{', '.join(_AXIS_TYPES)} (one for all axes or a list, one per axis)"
            )
    return tuple(out)


def _given(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or `default` if the key is missing or null (never for ``[]`` or ``""``)."""
    value = cfg.get(key)
    return default if value is None else value


def mesh_spec(cfg_mesh: Any) -> MeshSpec:
    """Parses and statically validates a mesh config node.

    Missing (or null) keys take defaults: ``axes=[data]``; ``ici`` -1 on the first axis and 1
    elsewhere; ``dcn`` all 1; ``data_axes`` the first axis; ``axis_types=auto``;
    ``num_devices=null``; ``simulate_on_cpu=false``. So ``{}`` puts every device on ``data``.
    An empty list (``axes=[]``) is an error, not the default.

    Args:
      cfg_mesh: the ``mesh`` node: an OmegaConf ``DictConfig``, a mapping or a dataclass.

    Returns:
      The parsed `MeshSpec`.

    Raises:
      MeshConfigError: for an unknown key, empty or duplicate axis names, groups whose
        lengths differ from ``axes``, more than one -1 in a group, bad sizes or axis types,
        data axes that are not mesh axes, or ``simulate_on_cpu`` without ``num_devices``.
    """
    cfg = _to_dict(cfg_mesh)
    unknown = sorted(set(cfg) - set(_KNOWN_KEYS))
    if unknown:
        raise MeshConfigError(f"{KEY}: unknown keys {unknown}. Allowed: {', '.join(_KNOWN_KEYS)}")
    axes = _names(_given(cfg, "axes", ("data",)), "axes")
    ici_default = (-1,) + (1,) * (len(axes) - 1)
    ici = _sizes(cfg["ici"] if cfg.get("ici") is not None else ici_default, "ici", axes)
    dcn = _sizes(cfg["dcn"] if cfg.get("dcn") is not None else (1,) * len(axes), "dcn", axes)
    data = _names(_given(cfg, "data_axes", axes[:1]), "data_axes", "; null: the first axis")
    missing = [a for a in data if a not in axes]
    if missing:
        raise MeshConfigError(
            f"{KEY}.data_axes={list(data)}: {missing} not in {KEY}.axes={list(axes)}"
        )
    num_devices = cfg.get("num_devices")
    if num_devices is not None and (
        isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1
    ):
        raise MeshConfigError(
            f"{KEY}.num_devices={num_devices!r}: expected a positive integer or null"
        )
    simulate = _given(cfg, "simulate_on_cpu", False)
    if not isinstance(simulate, bool):
        raise MeshConfigError(f"{KEY}.simulate_on_cpu={simulate!r}: expected true or false")
    if simulate and num_devices is None:
        raise MeshConfigError(
            f"{KEY}.simulate_on_cpu=true needs {KEY}.num_devices (how many CPU devices to "
            "simulate), e.g. mesh.num_devices=8"
        )
    return MeshSpec(
        axes=axes,
        ici=ici,
        dcn=dcn,
        data_axes=data,
        axis_types=_axis_types(_given(cfg, "axis_types", "auto"), axes),
        num_devices=num_devices,
        simulate_on_cpu=simulate,
        name=cfg.get("name"),
    )


def data_axes(cfg_mesh: Any) -> tuple[str, ...]:
    """Returns the data-parallel axes of a mesh config (``data_axes``, default: first axis).

    The trainer splits the global batch over these axes and reduces gradients over them.

    Raises:
      MeshConfigError: if the config is invalid (see `mesh_spec`).
    """
    return mesh_spec(cfg_mesh).data_axes


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------


def _fill(sizes: tuple[int, ...], target: int, key: str, what: str) -> tuple[int, ...]:
    """Replaces the -1 in `sizes` so that their product is `target`."""
    if -1 not in sizes:
        return sizes
    known = math.prod(s for s in sizes if s != -1)
    if target % known:
        raise MeshConfigError(
            f"{KEY}.{key}={list(sizes)}: cannot resolve -1: {what} ({target}) is not "
            f"divisible by {known}, the product of the other {key} sizes"
        )
    return tuple(target // known if s == -1 else s for s in sizes)


def resolve_axis_sizes(
    spec: MeshSpec, num_devices: int, num_slices: int = 1
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Resolves the -1 entries of ``ici`` and ``dcn`` and checks the device count.

    The number of slices is ``prod(dcn)``. A -1 in ``dcn`` takes the devices left over by a
    fully given ``ici``; when both groups hold a -1, it takes `num_slices` (the slices
    detected on the devices). A -1 in ``ici`` takes the devices of a slice left over by the
    other ``ici`` sizes.

    Args:
      spec: the parsed config.
      num_devices: the number of devices the mesh must cover, exactly.
      num_slices: the number of slices detected (used only when both groups hold a -1).

    Returns:
      ``(ici, dcn)``, positive ints with ``prod(ici) * prod(dcn) == num_devices``.

    Raises:
      MeshConfigError: naming the keys, the axes, the products and the device count, if a -1
        cannot be resolved or the product differs from the device count.
    """
    ici, dcn = spec.ici, spec.dcn
    if -1 in dcn:
        if -1 in ici:
            dcn = _fill(dcn, num_slices, "dcn", "the number of slices")
        else:
            if num_devices % math.prod(ici):
                raise MeshConfigError(
                    f"{KEY}.dcn={list(dcn)}: cannot resolve -1: {num_devices} devices are not "
                    f"divisible by {math.prod(ici)}, the product of {KEY}.ici={list(ici)}"
                )
            dcn = _fill(dcn, num_devices // math.prod(ici), "dcn", "the number of slices")
    slices = math.prod(dcn)
    if -1 in ici:
        if num_devices % slices:
            raise MeshConfigError(
                f"{KEY}.ici={list(ici)}: cannot resolve -1: {num_devices} devices do not split "
                f"into {slices} slices (the product of {KEY}.dcn={list(dcn)})"
            )
        ici = _fill(ici, num_devices // slices, "ici", "the number of devices per slice")
    shape = tuple(i * d for i, d in zip(ici, dcn, strict=True))
    if math.prod(shape) != num_devices:
        raise MeshConfigError(
            f"{KEY}.ici={list(spec.ici)} x {KEY}.dcn={list(spec.dcn)} over axes "
            f"{list(spec.axes)} gives a mesh of shape {shape} = {math.prod(shape)} devices "
            f"(ici product {math.prod(ici)} x dcn product {math.prod(dcn)}), but there are "
            f"{num_devices} devices; the product must equal the device count (use -1 for "
            "'the remaining devices')"
        )
    return ici, dcn


def mesh_shape(cfg_mesh: Any, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """Returns ``{axis: dcn * ici}`` for a config on `num_devices` devices (no JAX needed).

    Raises:
      MeshConfigError: see `mesh_spec` and `resolve_axis_sizes`.
    """
    spec = mesh_spec(cfg_mesh)
    ici, dcn = resolve_axis_sizes(spec, num_devices, num_slices)
    return {a: i * d for a, i, d in zip(spec.axes, ici, dcn, strict=True)}
