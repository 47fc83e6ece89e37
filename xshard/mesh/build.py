"""Device meshes from config: named axes, ICI/DCN sizes, validation and CPU simulation.

A mesh config node (the Hydra group ``mesh``) names the axes in order of increasing
communication intensity and gives, per axis, a size within a slice (``ici``) and a size across
slices (``dcn``), as MaxText's ``ici_parallelism``/``dcn_parallelism``::

    name: 2xv5e-16
    num_devices: 32          # expected JAX device count (null: whatever is present)
    axes: [data, model]
    ici: [-1, 1]             # -1: the remaining devices of a slice (at most one per group)
    dcn: [2, 1]              # product = number of slices
    axis_types: auto         # auto | explicit (or one per axis)
    simulate_on_cpu: false   # run on `num_devices` simulated CPU devices
    data_axes: [data]        # the data-parallel axes

The mesh has one dimension per axis, of size ``dcn[i] * ici[i]``. Its device order comes from
``jax.experimental.mesh_utils``: ``create_device_mesh`` for one slice (topology-aware on TPU),
``create_hybrid_device_mesh`` for several.

Typical use, in a Hydra main::

    xshard.configure_devices(cfg.mesh)     # before any JAX computation
    mesh = xshard.build_mesh(cfg.mesh)
    axes = xshard.data_axes(cfg.mesh)
    xshard.check_batch_divisible(cfg.trainer.batch_size, mesh, axes)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from xshard.mesh.simulated import simulated_device_bound
from xshard.mesh.spec import (
    KEY,
    MeshConfigError,
    MeshSpec,
    data_axes,
    mesh_shape,
    mesh_spec,
    resolve_axis_sizes,
)

__all__ = [
    "MeshConfigError",
    "MeshSpec",
    "backends_initialized",
    "build_mesh",
    "check_axis_names",
    "check_batch_divisible",
    "configure_devices",
    "create_device_array",
    "data_axes",
    "data_parallel_size",
    "mesh_shape",
    "mesh_spec",
    "resolve_axis_sizes",
]

logger = logging.getLogger(__name__)

_LAUNCHER_HINT = (
    "The device count of a process is fixed once JAX has initialised its backends. This "
    "happens when Hydra's basic launcher runs several multirun jobs in one process: sweep "
    "over meshes with a process per job, `hydra/launcher=submitit_local` "
    "(pip install hydra-submitit-launcher), or run one command per mesh."
)


# ----------------------------------------------------------------------------------------------
# Devices: CPU simulation and the "already initialised" check
# ----------------------------------------------------------------------------------------------


def backends_initialized() -> bool:
    """Returns whether JAX has initialised its backends (after which the device count is fixed).

    Uses ``jax._src.xla_bridge.backends_are_initialized`` (jax 0.4 - 0.10), falling back to
    the private ``_backends`` registry, and to False if neither exists.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - private API moved
        return False
    fn = getattr(xla_bridge, "backends_are_initialized", None)
    if fn is not None:
        return bool(fn())
    return bool(getattr(xla_bridge, "_backends", None))  # pragma: no cover


def configure_devices(cfg_mesh: Any, num_processes: int = 1) -> int | None:
    """Sets up simulated CPU devices for ``simulate_on_cpu``; call before any JAX computation.

    With ``simulate_on_cpu=true`` this selects the CPU platform with ``num_devices`` devices
    in all (``jax_platforms=cpu``, ``jax_num_cpu_devices=n``; the latter takes precedence
    over ``XLA_FLAGS=--xla_force_host_platform_device_count``), split evenly over the
    processes of a multi-process run: ``mesh=cpu8`` on 2 processes gives each 4 devices.
    Otherwise it does nothing.

    Args:
      cfg_mesh: the ``mesh`` config node.
      num_processes: the processes of the run (``jax.distributed.initialize`` done before).

    Returns:
      The number of simulated CPU devices of this process, or None when not simulating.

    Raises:
      MeshConfigError: if the config is invalid, ``num_devices`` does not split evenly over
        the processes or is more than the platform can simulate per process
        (`xshard.mesh.simulated`), or JAX is already initialised with another device
        count or platform (e.g. Hydra's basic multirun launcher running several jobs in one
        process); the message points to ``hydra/launcher=submitit_local``.
    """
    spec = mesh_spec(cfg_mesh)
    if not spec.simulate_on_cpu:
        return None
    total = spec.num_devices
    assert total is not None  # checked by mesh_spec
    if total % num_processes:
        raise MeshConfigError(
            f"{KEY}={spec.name or '<custom>'} simulates {KEY}.num_devices={total} CPU devices, "
            f"which do not split evenly over {num_processes} processes: choose a mesh whose "
            f"num_devices is a multiple of {num_processes}."
        )
    n = total // num_processes
    if backends_initialized():
        devices = jax.local_devices()
        if devices[0].platform == "cpu" and len(devices) == n:
            return n
        raise MeshConfigError(_already_initialized_message(spec, devices, n))
    _check_simulated_count(total, n, num_processes)
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # backends initialised concurrently or the check above missed it
        raise MeshConfigError(_already_initialized_message(spec, jax.local_devices(), n)) from e
    return n


def _check_simulated_count(total: int, n: int, num_processes: int) -> None:
    """Refuses more simulated CPU devices per process than the platform can give, before
    JAX initialises (`xshard.mesh.simulated` says why and measures the bound)."""
    bound = simulated_device_bound()
    if n > bound.limit:
        per = f" ({n} per process of {num_processes})" if num_processes > 1 else ""
        most = bound.limit * num_processes
        raise MeshConfigError(
            f"{KEY}.num_devices={total}: simulated CPU devices{per} must be 1 to {most} here: "
            f"{bound.reason}. Choose a smaller {KEY}.num_devices."
        )


def _already_initialized_message(spec: MeshSpec, devices: Sequence[Any], n: int) -> str:
    return (
        f"{KEY}={spec.name or '<custom>'} with {KEY}.simulate_on_cpu=true needs "
        f"{n} simulated CPU devices in this process, but JAX is already initialised in this "
        f"process with {len(devices)} {devices[0].platform} devices. {_LAUNCHER_HINT}"
    )


def _num_granules(devices: Sequence[Any], attr: str) -> int:
    return len({getattr(d, attr) for d in devices}) if hasattr(devices[0], attr) else 1


def create_device_array(
    ici: Sequence[int], dcn: Sequence[int], devices: Sequence[Any]
) -> np.ndarray:
    """Arranges `devices` into an array of shape ``dcn * ici`` (per axis).

    One slice (``prod(dcn) == 1``): ``mesh_utils.create_device_mesh`` (topology-aware on TPU).
    Several: ``mesh_utils.create_hybrid_device_mesh``, whose granules (the units joined by
    DCN) are the slices when the devices carry that many distinct ``slice_index`` values,
    else the processes when there are that many (``process_is_granule=True``, e.g. multi-host
    CPU or GPU). On a single process of CPU devices (simulated slices) the devices are
    split, in order, into ``prod(dcn)`` equal contiguous granules and assembled the same way,
    so a multi-slice config can be dry-run on one machine.

    Args:
      ici: resolved per-axis sizes within a granule.
      dcn: resolved per-axis numbers of granules.
      devices: the devices, ``prod(ici) * prod(dcn)`` of them.

    Returns:
      An object array of devices, ready for ``jax.sharding.Mesh``.

    Raises:
      MeshConfigError: if the devices span several slices/processes whose number is not
        ``prod(dcn)``, or ``mesh_utils`` cannot map the shape onto the physical topology.
    """
    granules = math.prod(dcn)
    slices = _num_granules(devices, "slice_index")
    processes = _num_granules(devices, "process_index")
    try:
        if granules == 1:
            return mesh_utils.create_device_mesh(tuple(ici), devices)
        if slices == granules:
            return mesh_utils.create_hybrid_device_mesh(tuple(ici), tuple(dcn), devices)
        if processes == granules:
            return mesh_utils.create_hybrid_device_mesh(
                tuple(ici), tuple(dcn), devices, process_is_granule=True
            )
    except ValueError as e:
        raise MeshConfigError(
            f"{KEY}: cannot lay out ici={list(ici)} dcn={list(dcn)} on {len(devices)} "
            f"{devices[0].device_kind} devices ({slices} slices, {processes} processes): {e}"
        ) from e
    if slices > 1 or processes > 1 or devices[0].platform != "cpu":
        raise MeshConfigError(
            f"{KEY}.dcn={list(dcn)} asks for {granules} slices (its product) but the devices "
            f"span {slices} slices and {processes} processes of {devices[0].platform} devices; "
            "the dcn product must equal one of them (only CPU devices of one process are split "
            "into simulated slices)"
        )
    logger.info(
        "%s: single process, simulating %d DCN granules of %d devices each",
        KEY,
        granules,
        len(devices) // granules,
    )
    size = len(devices) // granules
    per_granule = [
        mesh_utils.create_device_mesh(tuple(ici), devices[g * size : (g + 1) * size])
        for g in range(granules)
    ]
    layout = np.arange(granules).reshape(tuple(dcn))
    blocks = np.vectorize(lambda g: per_granule[g], otypes=[object])(layout)
    return np.block(blocks.tolist())


# ----------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------


def _check_device_count(spec: MeshSpec, devices: Sequence[Any]) -> None:
    """Checks ``num_devices`` and ``simulate_on_cpu`` against the devices present."""
    platform = devices[0].platform
    present = f"{len(devices)} {platform} device{'s' * (len(devices) != 1)}"
    name = spec.name or "<custom>"
    if spec.simulate_on_cpu and (platform != "cpu" or len(devices) != spec.num_devices):
        processes = jax.process_count()
        if processes > 1:
            hint = (
                f"with {processes} processes, call xshard.configure_devices(cfg.mesh, "
                f"num_processes={processes}) after jax.distributed.initialize and before any "
                "JAX computation: each process then simulates its share of the devices."
            )
        else:
            hint = (
                "call xshard.configure_devices(cfg.mesh) before any JAX computation. "
                + _LAUNCHER_HINT
            )
        raise MeshConfigError(
            f"{KEY}={name} has {KEY}.simulate_on_cpu=true with {KEY}.num_devices="
            f"{spec.num_devices}, but JAX has {present}"
            + (f" over {processes} processes" if processes > 1 else "")
            + f": {hint}"
        )
    if spec.num_devices is not None and spec.num_devices != len(devices):
        raise MeshConfigError(
            f"{KEY}={name} expects {KEY}.num_devices={spec.num_devices} devices (axes "
            f"{list(spec.axes)}, ici={list(spec.ici)}, dcn={list(spec.dcn)}) but JAX has "
            f"{present}. Dry-run it on simulated CPU devices with {KEY}.simulate_on_cpu=true, "
            f"choose a preset for {len(devices)} devices (e.g. {KEY}=auto), or set "
            f"{KEY}.num_devices=null"
        )


def build_mesh(cfg_mesh: Any, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the ``jax.sharding.Mesh`` described by a mesh config node.

    Args:
      cfg_mesh: the ``mesh`` node (DictConfig, mapping or dataclass; see the module docstring).
      devices: the devices to use; default ``jax.devices()`` (all processes).

    Returns:
      A mesh with axes ``cfg_mesh.axes`` of sizes ``dcn[i] * ici[i]`` and the configured axis
      types (``Auto`` by default).

    Raises:
      MeshConfigError: if the config is invalid (see `mesh_spec`), ``num_devices`` differs
        from the devices present, a -1 cannot be resolved, the sizes do not multiply to the
        device count, or the layout does not fit the slices/processes.
    """
    spec = mesh_spec(cfg_mesh)
    devices = list(jax.devices() if devices is None else devices)
    _check_device_count(spec, devices)
    ici, dcn = resolve_axis_sizes(spec, len(devices), _num_granules(devices, "slice_index"))
    array = create_device_array(ici, dcn, devices)
    mesh = Mesh(array, spec.axes, axis_types=spec.axis_types)
    logger.info(
        "%s=%s: axes %s, shape %s (ici %s, dcn %s), %s",
        KEY,
        spec.name,
        spec.axes,
        array.shape,
        ici,
        dcn,
        [t.name for t in spec.axis_types],
    )
    return mesh


# ----------------------------------------------------------------------------------------------
# Checks the trainer uses
# ----------------------------------------------------------------------------------------------


def check_axis_names(
    mesh: Mesh, axis_name: str | Sequence[str], key: str = "reduction.axis_name"
) -> tuple[str, ...]:
    """Checks that `axis_name` (one name or several) names axes of `mesh`.

    Args:
      mesh: a ``Mesh`` or ``AbstractMesh``.
      axis_name: a mesh axis name or a sequence of them (e.g. a reduction axis).
      key: the config key `axis_name` came from, for the error message.

    Returns:
      The axis names as a tuple.

    Raises:
      MeshConfigError: naming `key`, the bad names and the mesh axes.
    """
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    allowed = f"Allowed: {list(mesh.axis_names)} (mesh shape {dict(mesh.shape)})"
    bad = [n for n in names if n not in mesh.axis_names]
    if bad or not names:
        raise MeshConfigError(f"{key}={axis_name!r}: {bad} not an axis of the mesh. {allowed}")
    if len(set(names)) != len(names):
        raise MeshConfigError(f"{key}={axis_name!r}: an axis is named twice. {allowed}")
    return names


def data_parallel_size(mesh: Mesh, axes: str | Sequence[str]) -> int:
    """Returns the number of data-parallel shards: the product of the sizes of `axes`.

    Raises:
      MeshConfigError: if an axis is not in the mesh.
    """
    names = check_axis_names(mesh, axes, key=f"{KEY}.data_axes")
    return math.prod(mesh.shape[n] for n in names)


def check_batch_divisible(
    global_batch: int,
    mesh: Mesh,
    data_axes: str | Sequence[str],
    key: str = "trainer.batch_size",
) -> int:
    """Checks that the global batch splits evenly over the data-parallel axes.

    Args:
      global_batch: the global batch size.
      mesh: the mesh.
      data_axes: the data-parallel axes of `mesh`.
      key: the config key of `global_batch`, for the error message.

    Returns:
      The per-shard batch size, ``global_batch // data_parallel_size``.

    Raises:
      MeshConfigError: naming `key`, the value, the axes, their sizes and the nearest valid
        batch sizes.
    """
    n = data_parallel_size(mesh, data_axes)
    valid = isinstance(global_batch, int) and not isinstance(global_batch, bool)
    if not valid or global_batch < 1 or global_batch % n:
        below = (global_batch // n) * n if valid else 0
        lower = max(n, below)
        upper = lower + n
        names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
        raise MeshConfigError(
            f"{key}={global_batch!r} is not divisible by the data-parallel size {n} (mesh axes "
            f"{list(names)} of sizes {[mesh.shape[a] for a in names]}, mesh shape "
            f"{dict(mesh.shape)}, {mesh.size} devices); use a positive multiple of {n}, e.g. "
            f"{lower} or {upper}"
        )
    return global_batch // n
