"""Tests of `xshard.mesh`: presets, ICI/DCN shapes, validation and CPU simulation.

This process has 8 simulated CPU devices (conftest.py). Presets of another size build in
subprocesses, one per device count, on `num_devices` simulated CPU devices. The DCN layout is
tested on one process (simulated granules) and, for the slice/process granule dispatch, on
stand-in device objects; the true multi-host case (two processes joined by gloo) belongs to the
multi-host tests.
"""

from __future__ import annotations

import json
import math
import textwrap
import types

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from omegaconf import OmegaConf

import xshard
from tests.mesh_helpers import NUM_DEVICES, TPU_DEVICES, _run, presets
from xshard.mesh.build import (
    MeshConfigError,
    build_mesh,
    check_axis_names,
    check_batch_divisible,
    configure_devices,
    create_device_array,
    data_axes,
    data_parallel_size,
    mesh_shape,
)
from xshard.mesh.spec import mesh_spec


def _expect(cfg: dict, shape: tuple[int, ...], names: tuple[str, ...], n: int | None) -> None:
    """Checks a built mesh (`shape`, `names`) against its preset `cfg` on `n` devices."""
    assert names == tuple(cfg["axes"])
    assert math.prod(shape) == (n or NUM_DEVICES)
    spec = mesh_spec(cfg)  # null ici/dcn take mesh_spec's defaults
    for size, ici, dcn in zip(shape, spec.ici, spec.dcn, strict=True):
        if ici != -1 and dcn != -1:
            assert size == ici * dcn


def _sized(n: int | None) -> bool:
    return n in (None, NUM_DEVICES)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


def test_required_presets_exist_with_the_right_device_counts():
    found = presets()
    for name in ("auto", "cpu8", "cpu4x2", *TPU_DEVICES):
        assert name in found, f"missing preset conf/mesh/{name}.yaml"
    for name, n in TPU_DEVICES.items():
        assert found[name]["num_devices"] == n, name
        assert found[name]["name"] == name
    assert found["cpu8"]["simulate_on_cpu"] and found["cpu4x2"]["simulate_on_cpu"]
    assert found["auto"]["num_devices"] is None
    assert math.prod(found["2xv5e-16"]["dcn"]) == 2


@pytest.mark.parametrize("name", [n for n, c in presets().items() if _sized(c["num_devices"])])
def test_preset_builds_in_process(name):
    cfg = dict(presets()[name])
    if cfg["num_devices"] is not None:
        cfg["simulate_on_cpu"] = True  # no-op here: already 8 CPU devices
        assert configure_devices(cfg) == NUM_DEVICES
    mesh = build_mesh(cfg)
    _expect(cfg, tuple(mesh.devices.shape), mesh.axis_names, cfg["num_devices"])
    assert mesh.axis_types == (AxisType.Auto,) * len(mesh.axis_names)
    assert data_axes(cfg) == tuple(cfg["data_axes"] or cfg["axes"][:1])  # null: the first axis


def test_cpu_presets_shapes():
    assert dict(build_mesh(presets()["cpu8"]).shape) == {"data": 8}
    slices = presets()["cpu2x4_slices"]
    assert dict(build_mesh(slices).shape) == {"slice": 2, "data": 4}
    assert data_axes(slices) == ("slice", "data")
    # slice is the DCN axis: each slice holds 4 contiguous devices
    assert [sorted(d.id for d in row) for row in build_mesh(slices).devices] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert dict(build_mesh(presets()["cpu4x2"]).shape) == {"data": 4, "model": 2}
    assert dict(build_mesh(OmegaConf.create(presets()["auto"])).shape) == {"data": 8}


_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    from xshard.mesh.build import backends_initialized, build_mesh, configure_devices
    assert not backends_initialized()
    out = {}
    for name, cfg in json.loads(sys.argv[1]).items():
        cfg["simulate_on_cpu"] = True
        configure_devices(cfg)
        mesh = build_mesh(cfg)
        out[name] = dict(axes=list(mesh.axis_names), shape=list(mesh.devices.shape),
                         ids=[d.id for d in mesh.devices.flat],
                         types=[t.name for t in mesh.axis_types])
    print(json.dumps(out))
    """
)


def _other_sizes() -> list[int]:
    return sorted({c["num_devices"] for c in presets().values() if not _sized(c["num_devices"])})


@pytest.mark.slow
@pytest.mark.parametrize("n", _other_sizes())
def test_presets_build_on_simulated_devices_of_their_size(n):
    batch = {k: c for k, c in presets().items() if c["num_devices"] == n}
    proc = _run(_SUBPROCESS, json.dumps(batch))
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(built) == set(batch)
    for name, got in built.items():
        _expect(batch[name], tuple(got["shape"]), tuple(got["axes"]), n)
        assert got["types"] == ["Auto"] * len(got["axes"])
        assert sorted(got["ids"]) == list(range(n))
    if "2xv5e-16" in built:  # `slice` spans 2 simulated slices of 16 contiguous devices
        got = built["2xv5e-16"]
        assert got["axes"] == ["slice", "data", "model"]
        assert got["shape"] == [2, 16, 1]
        assert sorted(got["ids"][:16]) == list(range(16))


# ----------------------------------------------------------------------------------------------
# Shapes: -1, DCN, axis types
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, n, slices, shape",
    [
        ({}, 8, 1, {"data": 8}),
        ({"axes": ["data", "model"], "ici": [-1, 2]}, 8, 1, {"data": 4, "model": 2}),
        ({"axes": ["data", "model"], "ici": [2, -1]}, 8, 1, {"data": 2, "model": 4}),
        ({"axes": ["d", "m"], "ici": [-1, 1], "dcn": [2, 1]}, 32, 1, {"d": 32, "m": 1}),
        ({"axes": ["d", "m"], "ici": [4, 1], "dcn": [-1, 1]}, 16, 1, {"d": 16, "m": 1}),
        ({"axes": ["d", "m"], "ici": [-1, 2], "dcn": [-1, 1]}, 32, 4, {"d": 16, "m": 2}),
        ({"axes": ["d"], "ici": [-1], "dcn": [-1]}, 256, 1, {"d": 256}),
    ],
)
def test_mesh_shape_resolves_minus_one(cfg, n, slices, shape):
    assert mesh_shape(cfg, n, slices) == shape


def test_dcn_on_one_process_uses_contiguous_granules():
    mesh = build_mesh({"axes": ["data", "model"], "ici": [4, 1], "dcn": [2, 1]})
    assert mesh.devices.shape == (8, 1)
    assert [d.id for d in mesh.devices[:4, 0]] == [0, 1, 2, 3]  # granule 0 first on `data`
    mesh = build_mesh({"axes": ["data", "model"], "ici": [2, 2], "dcn": [1, 2]})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert {d.id for d in mesh.devices[:, :2].flat} == {0, 1, 2, 3}  # granule 0 on `model`
    assert {d.id for d in mesh.devices[:, 2:].flat} == {4, 5, 6, 7}


def _fake_devices(n: int, granule_of, attr: str) -> list[types.SimpleNamespace]:
    """Stand-ins for devices of several processes (or slices of 2 processes each)."""
    return [
        types.SimpleNamespace(
            **{
                "id": i,
                "platform": "cpu",
                "device_kind": "cpu",
                "process_index": i // 2,
                attr: granule_of(i),
            }
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("attr", ["process_index", "slice_index"])
def test_dcn_granules_are_processes_or_slices(attr):
    # Interleaved granules: the hybrid path must group by granule, not by position.
    devices = _fake_devices(8, lambda i: i % 2, attr)
    if attr == "process_index":  # process granules: no slice_index attribute
        for d in devices:
            assert not hasattr(d, "slice_index")
    array = create_device_array((4, 1), (2, 1), devices)
    assert array.shape == (8, 1)
    assert [d.id for d in array[:4, 0]] == [0, 2, 4, 6]
    assert [d.id for d in array[4:, 0]] == [1, 3, 5, 7]


def test_dcn_product_must_match_the_granules():
    devices = _fake_devices(8, lambda i: i // 4, "process_index")
    with pytest.raises(MeshConfigError, match=r"mesh.dcn=\[4, 1\].*4 slices.*2 processes"):
        create_device_array((2, 1), (4, 1), devices)
    gpus = [
        types.SimpleNamespace(id=i, platform="gpu", device_kind="gpu", process_index=0)
        for i in range(8)
    ]  # simulated slices are for CPU devices only
    with pytest.raises(MeshConfigError, match=r"2 slices.*1 processes of gpu devices"):
        create_device_array((4, 1), (2, 1), gpus)


def test_axis_types():
    mesh = build_mesh({"axes": ["data", "model"], "ici": [4, 2], "axis_types": "explicit"})
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    cfg = {"axes": ["data", "model"], "ici": [4, 2], "axis_types": ["auto", "Explicit"]}
    mesh = build_mesh(cfg)
    assert mesh.axis_types == (AxisType.Auto, AxisType.Explicit)


def test_accepts_dictconfig_and_dict():
    cfg = {"axes": ["data", "model"], "ici": [4, 2], "dcn": [1, 1], "num_devices": 8}
    assert build_mesh(OmegaConf.create(cfg)).shape == build_mesh(cfg).shape
    assert xshard.build_mesh is build_mesh
    assert issubclass(MeshConfigError, ValueError)


# ----------------------------------------------------------------------------------------------
# Trainer helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_4x2():
    return build_mesh(presets()["cpu4x2"])


def test_data_axes_defaults_to_first_axis():
    assert data_axes({"axes": ["replica", "data"]}) == ("replica",)
    assert data_axes(OmegaConf.create({"axes": ["a", "b"], "data_axes": ["a", "b"]})) == ("a", "b")


def test_data_parallel_size(mesh_4x2):
    assert data_parallel_size(mesh_4x2, "data") == 4
    assert data_parallel_size(mesh_4x2, ["data", "model"]) == 8


def test_check_batch_divisible(mesh_4x2):
    assert check_batch_divisible(64, mesh_4x2, ["data"]) == 16
    assert check_batch_divisible(8, mesh_4x2, ("data", "model")) == 1
    with pytest.raises(MeshConfigError) as e:
        check_batch_divisible(30, mesh_4x2, ["data"])
    msg = str(e.value)
    for p in ["trainer.batch_size=30", "data-parallel size 4", "['data']", "sizes [4]", "28 or 32"]:
        assert p in msg, (p, msg)
    with pytest.raises(MeshConfigError, match=r"micro=0 .* size 8"):
        check_batch_divisible(0, mesh_4x2, ["data", "model"], key="micro")


def test_check_axis_names(mesh_4x2):
    assert check_axis_names(mesh_4x2, "data") == ("data",)
    assert check_axis_names(mesh_4x2, ["data", "model"]) == ("data", "model")
    with pytest.raises(MeshConfigError) as e:
        check_axis_names(mesh_4x2, "batch")
    msg = str(e.value)
    for p in [
        "reduction.axis_name='batch'",
        "['batch']",
        "['data', 'model']",
        "{'data': 4, 'model': 2}",
    ]:
        assert p in msg, (p, msg)
    with pytest.raises(MeshConfigError, match="named twice"):
        check_axis_names(mesh_4x2, ["data", "data"])


def test_device_array_is_a_permutation_of_devices():
    array = create_device_array((2, 4), (1, 1), jax.devices())
    assert isinstance(array, np.ndarray) and array.shape == (2, 4)
    assert sorted(d.id for d in array.flat) == list(range(NUM_DEVICES))
