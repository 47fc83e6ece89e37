"""`xshard.mesh` validation: each bad config is a clear MeshConfigError naming the key, the
axes, the products and the device count; CPU simulation after JAX has started."""

from __future__ import annotations

import textwrap

import jax
import pytest

from tests.mesh_helpers import NUM_DEVICES, _run, presets
from xshard.mesh.build import (
    MeshConfigError,
    backends_initialized,
    build_mesh,
    configure_devices,
)

# ----------------------------------------------------------------------------------------------
# Validation errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, patterns",
    [
        (
            {"axes": ["data", "model"], "ici": [2, 2]},
            [
                "mesh.ici=[2, 2]",
                "mesh.dcn=[1, 1]",
                "['data', 'model']",
                "(2, 2) = 4 devices",
                "there are 8 devices",
            ],
        ),
        (
            {"axes": ["data", "model"], "ici": [4, 2], "dcn": [2, 1]},
            ["ici product 8 x dcn product 2", "16 devices", "there are 8 devices"],
        ),
        ({"axes": ["data", "model"], "ici": [-1, -1]}, ["mesh.ici=[-1, -1]", "at most one -1"]),
        ({"axes": ["data", "model"], "dcn": [-1, -1]}, ["mesh.dcn=[-1, -1]", "at most one -1"]),
        (
            {"axes": ["data", "model"], "ici": [-1, 3]},
            ["mesh.ici=[-1, 3]", "cannot resolve -1", "(8)", "divisible by 3"],
        ),
        (
            {"axes": ["data", "model"], "ici": [3, 1], "dcn": [-1, 1]},
            ["mesh.dcn=[-1, 1]", "cannot resolve -1", "8 devices", "divisible by 3"],
        ),
        ({"axes": ["data", "data"]}, ["mesh.axes=['data', 'data']", "duplicate", "['data']"]),
        (
            {"axes": ["data", "model"], "ici": [8]},
            ["mesh.ici=[8] has 1 entries", "mesh.axes=['data', 'model'] has 2"],
        ),
        ({"axes": ["data"], "dcn": [1, 1]}, ["mesh.dcn=[1, 1] has 2 entries"]),
        ({"axes": ["data"], "ici": [0]}, ["mesh.ici=[0]", "positive integers or -1"]),
        (
            {"axes": ["data"], "data_axes": ["batch"]},
            ["mesh.data_axes=['batch']", "['batch'] not in mesh.axes=['data']"],
        ),
        ({"axis_types": "manual"}, ["mesh.axis_types='manual'", "auto, explicit"]),
        ({"ici_parallelism": [8]}, ["unknown keys ['ici_parallelism']", "Allowed:", "ici"]),
        ({"simulate_on_cpu": True}, ["mesh.simulate_on_cpu=true needs mesh.num_devices"]),
    ],
)
def test_config_errors(cfg, patterns):
    with pytest.raises(MeshConfigError) as e:
        build_mesh(cfg)
    for p in patterns:
        assert p in str(e.value), (p, str(e.value))


def test_preset_of_another_size_suggests_simulation():
    cfg = dict(presets()["v5e-16"])
    with pytest.raises(MeshConfigError) as e:
        build_mesh(cfg)
    msg = str(e.value)
    for p in [
        "mesh=v5e-16",
        "mesh.num_devices=16",
        "8 cpu devices",
        "mesh.simulate_on_cpu=true",
        "mesh=auto",
    ]:
        assert p in msg, (p, msg)


def test_simulated_preset_without_configure_devices():
    cfg = {"name": "tiny", "num_devices": 4, "simulate_on_cpu": True}
    with pytest.raises(MeshConfigError, match=r"configure_devices\(cfg.mesh\)"):
        build_mesh(cfg)


def test_configure_devices_after_init_with_another_count():
    jax.devices()
    assert backends_initialized()
    assert configure_devices({"num_devices": 8}) is None  # not simulating: nothing to do
    with pytest.raises(MeshConfigError) as e:
        configure_devices({"name": "cpu4", "num_devices": 4, "simulate_on_cpu": True})
    msg = str(e.value)
    for p in [
        "mesh=cpu4",
        "4 simulated CPU devices",
        "already initialised",
        "8 cpu devices",
        "hydra/launcher=submitit_local",
    ]:
        assert p in msg, (p, msg)
    assert jax.device_count() == NUM_DEVICES


@pytest.mark.slow
def test_configure_devices_in_a_multirun_like_process():
    # As Hydra's basic launcher does: job 1 (cpu8) initialises JAX, job 2 wants 4 devices.
    script = textwrap.dedent(
        """
        import sys
        import jax.numpy as jnp
        from xshard.mesh.build import MeshConfigError, build_mesh, configure_devices
        cpu8 = dict(name="cpu8", num_devices=8, simulate_on_cpu=True)
        assert configure_devices(cpu8) == 8
        build_mesh(cpu8); jnp.ones(3).block_until_ready()
        try:
            configure_devices(dict(name="v4-8", num_devices=4, simulate_on_cpu=True))
        except MeshConfigError as e:
            print(e); sys.exit(0)
        sys.exit("no error")
        """
    )
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    assert "mesh=v4-8" in proc.stdout and "8 cpu devices" in proc.stdout
    assert "hydra/launcher=submitit_local" in proc.stdout
