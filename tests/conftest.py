"""Test setup: every test process sees 8 simulated CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set here, at
import time, before any test module imports JAX. Subprocesses inherit it via XLA_FLAGS.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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


#: The longest test files (minutes each: benchmark smoke runs, wheel builds, multi-process
#: CLI runs), scheduled first. `make test` runs two pytest-xdist workers, one file at a time
#: each (``--dist loadfile``); a long file left to the end would run alone on one core.
LONGEST_FIRST = (
    "test_benchmarks_smoke.py",
    "test_zero_bench_smoke.py",
    "test_reductions_bench_smoke.py",
    "test_example_repo.py",
    "test_scaffold_repo.py",
    "test_multihost_cli.py",
    "test_stream_multihost_cli.py",
    "test_flax_tasks.py",
    "test_zero.py",
    "test_zero_cli.py",
    "test_reliability_cli.py",
    "test_ckpt_owner_cli.py",
    "test_sweeps_cli.py",
    "test_io_faults_cli.py",
    "test_cli_train.py",
    "test_precision_cli.py",
    "test_data_cli.py",
    "test_multihost.py",
)


#: Markers by cost, given to every test of these files (pyproject.toml lists them): select or
#: skip them with -m, e.g. ``make test-fast PYTEST_ARGS="-m 'not multiprocess'"``.
COST_MARKERS = {
    "multiprocess": (
        "test_multihost.py",
        "test_multihost_cli.py",
        "test_launch_mistakes_cli.py",
        "test_stop_agreement.py",
        "test_exact_eval_multihost_cli.py",
        "test_stream_multihost_cli.py",
        "test_periodic_multihost_cli.py",
    ),
    "wheel": ("test_packaging.py", "test_example_repo.py", "test_scaffold_repo.py"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks tests by cost (`COST_MARKERS`) and runs the files of `LONGEST_FIRST` first, in
    that order (stable: the rest keep theirs)."""
    for item in items:
        for marker, files in COST_MARKERS.items():
            if item.path.name in files:
                item.add_marker(marker)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
