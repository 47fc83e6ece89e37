"""Bytes crossing each mesh axis, read from a compiled program's collectives.

`collectives_by_axis` parses ``compiled.as_text()`` (the partitioned per-device program): every
collective instruction, its result shape and its replica groups (or, for a
``collective-permute``, its source/target pairs). Each group is mapped onto the mesh: a
program jitted over a mesh numbers its devices in the mesh's order, so device id ``i`` sits at
``np.unravel_index(i, mesh shape)``, and a collective *spans* the axes along which the members
of its groups differ.

Bytes are what one device sends per call under bandwidth-optimal algorithms over a group of
``n`` devices, ``B`` the bytes of the collective's result:

* all-reduce: ``2 (n - 1) / n * B`` (ring reduce-scatter + all-gather);
* all-gather: ``(n - 1) / n * B``; reduce-scatter: ``(n - 1) * B`` (its result is 1/n);
* all-to-all: ``(n - 1) / n * B``; collective-permute: ``B`` per source device.

They are counted twice over for the slow axis:

* ``flat``: the whole collective is charged to every axis it spans (a single all-reduce over
  ``slice`` and ``data`` counts ``2 (8 - 1) / 8 * B`` as crossing ``slice``: an upper bound,
  and what a flat ring over the 8 devices sends);
* ``hierarchical``: a collective spanning several axes is charged, on each axis, what a
  hierarchical algorithm sends over that axis alone: the same formula with ``n`` the axis's size
  on ``B`` divided by the sizes of the other spanned axes (reduce-scatter within a slice first,
  the slow axis carries ``1 / D`` of the data, as XLA does on a TPU multi-slice mesh). For a
  collective over one axis both are the same.

On XLA:CPU's simulated devices a collective is a memory copy: these are the bytes the same
program would send over a network, not anything measured on the wire.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from benchmarks.hlo import dtype_bytes, operand_shapes

_OPS = "all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>" + _OPS + r")(?P<start>-start)?\("
)
_EXPLICIT = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(
    r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>(?:\{[\d,]+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program, placed on the mesh.

    Attributes:
      op: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
        ``collective-permute`` (an async ``-start`` counts as its op).
      dtypes: the element types of its result arrays.
      result_bytes: bytes of its result (all arrays of a tuple), per device.
      group_size: devices per replica group (2 for a collective-permute).
      axes: the mesh axes its groups span, in mesh order.
      flat_bytes: bytes one device sends per call (module docstring), averaged over the mesh's
        devices for a collective-permute whose pairs leave some devices out.
      hierarchical_bytes: per spanned axis, the bytes one device sends over that axis alone.
    """

    op: str
    dtypes: tuple[str, ...]
    result_bytes: int
    group_size: int
    axes: tuple[str, ...]
    flat_bytes: float
    hierarchical_bytes: dict[str, float]


def _sent(op: str, n: int, nbytes: float) -> float:
    """Bytes one device sends in `op` over a group of `n` with a result of `nbytes`."""
    if n <= 1:
        return 0.0
    if op == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if op == "reduce-scatter":
        return (n - 1) * nbytes
    if op == "collective-permute":
        return nbytes
    return (n - 1) / n * nbytes  # all-gather, all-to-all


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device ids of each group of the collective on `line` (every device: one group)."""
    if m := _PAIRS.search(line):
        return [[int(d) for d in p.split(",")] for p in re.findall(r"\{([\d,]+)\}", m["body"])]
    if m := _IOTA.search(line):
        ids = np.arange(math.prod(int(d) for d in m["dims"].split(",")))
        ids = ids.reshape([int(d) for d in m["dims"].split(",")])
        if m["perm"]:
            ids = ids.transpose([int(p) for p in m["perm"].split(",")])
        return ids.reshape([int(d) for d in m["shape"].split(",")]).tolist()
    if m := _MESH.search(line):
        named = re.findall(r"'([^']+)'=(\d+)", m["axes"])
        names = [name for name, _ in named]
        over_names = re.findall(r"'([^']+)'", m["over"])
        if not re.fullmatch(r"'[^']+'=\d+(?:,'[^']+'=\d+)*", m["axes"].replace(" ", "")) or (
            set(over_names) - set(names)
        ):  # sub-axes or explicit device lists: not parsed, so not guessed
            raise ValueError(f"unsupported mesh replica groups: {line.strip()[:200]}")
        over = [names.index(a) for a in over_names]
        ids = np.arange(num_devices).reshape([int(size) for _, size in named])
        rest = [i for i in range(len(names)) if i not in over]
        size = math.prod(ids.shape[i] for i in over)
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    if m := _EXPLICIT.search(line):
        groups = [
            [int(d) for d in g.split(",") if d.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", m["body"])
        ]
        if any(groups):
            return groups
    return [list(range(num_devices))]


def _spanned(
    groups: list[list[int]], shape: tuple[int, ...], names: Sequence[str]
) -> tuple[str, ...]:
    """The mesh axes along which the members of some group differ, in mesh order."""
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), shape)).T
        varying |= {i for i in range(len(shape)) if len(set(coords[:, i])) > 1}
    return tuple(names[i] for i in sorted(varying))


def collectives_by_axis(hlo: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective of `hlo` (``compiled.as_text()``), with the mesh axes it spans and the
    bytes it sends (module docstring).

    Args:
      hlo: the compiled, partitioned program's text.
      mesh_shape: the mesh's axis sizes in order (``dict(mesh.shape)``), the order of its
        devices in the program.

    Raises:
      ValueError: for a replica-group format this parser does not know.
    """
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    num_devices = math.prod(shape)
    out = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        shapes = operand_shapes(m["shape"])
        if m["start"] and len(shapes) > 1:  # async start: (operands..., results...)
            shapes = shapes[len(shapes) // 2 :]
        nbytes = sum(math.prod(dims) * dtype_bytes(t) for t, dims in shapes)
        groups = _groups(line, num_devices)
        axes = _spanned(groups, shape, names)
        n = 2 if m["op"] == "collective-permute" else max(len(g) for g in groups)
        share = (
            len({d for g in groups for d in g[:1]}) / num_devices
            if m["op"] == "collective-permute"
            else 1.0
        )
        flat = _sent(m["op"], n, nbytes) * share
        per_axis = {}
        for axis in axes:  # a permute's pairs are point to point: charged whole
            others = math.prod(mesh_shape[a] for a in axes if a != axis)
            size = mesh_shape[axis]
            per_axis[axis] = (
                flat if m["op"] == "collective-permute" else _sent(m["op"], size, nbytes / others)
            )
        out.append(
            Collective(m["op"], tuple(t for t, _ in shapes), nbytes, n, axes, flat, per_axis)
        )
    return out


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """What one program sends over one mesh axis, per device per call.

    Attributes:
      flat_bytes: bytes of the collectives spanning the axis, charged whole.
      hierarchical_bytes: the part a hierarchical algorithm sends over the axis itself.
      ops: the collectives spanning the axis, e.g. ``{"all-reduce f32": 1}``.
    """

    flat_bytes: float
    hierarchical_bytes: float
    ops: dict[str, int]


def traffic(collectives: Sequence[Collective], axis: str) -> AxisTraffic:
    """Sums the `collectives` that span `axis` (`AxisTraffic`)."""
    ops: dict[str, int] = {}
    flat = hier = 0.0
    for c in collectives:
        if axis not in c.axes:
            continue
        key = f"{c.op} {'+'.join(sorted(set(c.dtypes)))}"
        ops[key] = ops.get(key, 0) + 1
        flat += c.flat_bytes
        hier += c.hierarchical_bytes[axis]
    return AxisTraffic(flat, hier, ops)
