"""Helpers for the mesh tests: the presets as Hydra composes them, subprocess runs."""

from __future__ import annotations

import subprocess
import sys
from functools import cache

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from tests import REPO

CONF = REPO / "conf"
NUM_DEVICES = 8  # conftest.py

# Facts about TPU slices (JAX devices per slice type), checked against the presets.
TPU_DEVICES = {
    "v2-8": 8,  # 4 chips x 2 TensorCores, each core a device
    "v3-8": 8,
    "v4-8": 4,  # megacore: one device per chip
    "v4-32": 16,
    "v5p-8": 4,
    "v5e-8": 8,  # v5e/v6e names count chips, one core each
    "v5e-16": 16,
    "v5e-256": 256,
    "v6e-8": 8,
    "2xv5e-16": 32,
}


@cache
def presets() -> dict[str, dict]:
    """Every preset of the `mesh` group, as Hydra composes it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        names = GlobalHydra.instance().config_loader().get_group_options("mesh")
        return {n: OmegaConf.to_container(compose(overrides=[f"+mesh={n}"]).mesh) for n in names}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    # The inherited XLA_FLAGS asks for 8 devices; configure_devices must override it.
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
