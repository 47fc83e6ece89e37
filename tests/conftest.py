"""Test setup: every test process sees 8 simulated CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set here, at
import time, before any test module imports JAX, with the tests' own XLA flags
(`tests.TEST_XLA_FLAGS`). Subprocesses inherit both via XLA_FLAGS.
"""

import atexit
import os
import shutil
import tempfile

from tests import TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

# trainer.compilation_cache_dir defaults to $XDG_CACHE_HOME/xshard/jax: the tests' runs (and
# their subprocesses, which inherit it) cache their programs in a dir of this test process,
# never in the user's home.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xshard-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

NUM_DEVICES = 8

#: The wheel and a venv with it installed (`source`, `wheel`, `venv_python`).
pytest_plugins = ("tests.wheel_fixtures",)


@pytest.fixture
def compose_config(tmp_path):
    """``compose_config(*overrides)``: the trainer's config for task=mlp on 8 CPU devices,
    composed with Hydra's compose API, its outputs under `tmp_path`."""
    from hydra import compose, initialize_config_module

    def make(*overrides: str):
        with initialize_config_module("xshard.conf", version_base="1.3"):
            return compose(
                "xshard_train",
                overrides=[
                    "task=mlp",
                    "mesh=cpu8",
                    "trainer.batch_size=16",
                    "trainer.progress=false",
                    f"paths.output_dir={tmp_path}",
                    *overrides,
                ],
            )

    return make


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the files marked ``long`` first (stable: the rest keep their order). `make test`
    runs two pytest-xdist workers, one file at a time each (``--dist loadfile``); a file of
    minutes left to the end would run alone on one core. A file declares its cost markers
    itself (``pytestmark``), so a rename cannot leave a list here stale."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
