"""Sizes the machine cannot give (issue 32, route 9), through the real CLI under an 8 GiB
address-space limit, as the audit ran them: ``mesh.num_devices=4096|20000|1e6`` used to end in
a traceback, SIGABRT or SIGSEGV; ``task.hidden=[100000000]``, ``task.out_dim=1000000000`` and
``task.vocab_size=1000000000`` in a traceback (no thread, NumPy's MemoryError for 238 GiB, XLA's
out of memory). Each is now refused with exit 2 and one line naming the key, before JAX
initialises (the mesh) or before any array is allocated (the sizes); the default run passes
under the same limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import refused
from xshard.mesh.simulated import MAX_SIMULATED_CPU_DEVICES

pytestmark = pytest.mark.slow

CAP = 8 << 30  # the audit's memory cap (ulimit -v 8388608)

# The child sets the limit on itself and runs the CLI: `ulimit -v` without a shell, and
# without `preexec_fn` (a fork of the multithreaded test process).
_CAPPED_MAIN = (
    "import resource, runpy, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))\n"
    "sys.argv = ['trainers.train', *sys.argv[2:]]\n"
    "runpy.run_module('trainers.train', run_name='__main__', alter_sys=True)\n"
)


def train_capped(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m trainers.train OVERRIDES`` under an 8 GiB address-space limit (Hydra's
    flags among `overrides`, such as ``-m``, go first)."""
    flags = [o for o in overrides if o.startswith("-")]
    return subprocess.run(
        [
            sys.executable,
            "-c",
            _CAPPED_MAIN,
            str(CAP),
            *flags,
            "trainer.progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
            *(o for o in overrides if not o.startswith("-")),
        ],
        cwd=tmp_path,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def refused_cleanly(tmp_path: Path, result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2 with one line naming `fragments`, no traceback, no core dump."""
    line = refused(result, *fragments)
    assert "Traceback" not in result.stdout + result.stderr
    assert not list(tmp_path.glob("core*"))
    return line


@pytest.mark.parametrize(
    "value, message",
    [
        ("4096", "mesh.num_devices=4096: simulated CPU devices must be 1 to "),  # a traceback
        ("20000", "mesh.num_devices=20000: simulated CPU devices must be 1 to "),  # SIGABRT
        ("1000000", "mesh.num_devices=1000000: simulated CPU devices must be 1 to "),  # SIGSEGV
        ("1e6", "mesh.num_devices=1000000.0: expected a positive integer"),  # as int keys are
    ],
)
def test_simulated_devices_the_platform_cannot_give(tmp_path, value, message):
    line = refused_cleanly(tmp_path, train_capped(tmp_path, f"mesh.num_devices={value}"), message)
    if "must be 1 to " in message:  # the range under this limit, and why
        most = int(line.split("must be 1 to ")[1].split(" ")[0].rstrip(":"))
        assert 0 < most < 550 < MAX_SIMULATED_CPU_DEVICES  # XLA aborts at ~550 under 8 GiB
        assert "RLIMIT_AS" in line


@pytest.mark.parametrize(
    "overrides, named, largest",
    [
        (["task=mlp", "task.hidden=[100000000]"], "task.hidden=[100000000]", "layers/0/w"),
        (["task=mlp", "task.out_dim=1000000000"], "task.out_dim=1000000000", "layers/2/w"),
        (["task=tiny_gpt", "task.vocab_size=1000000000"], "task.vocab_size=1000000000", "embed"),
    ],
)
def test_a_model_too_large_for_the_memory_is_refused_before_allocating(
    tmp_path, overrides, named, largest
):
    result = train_capped(tmp_path, "checkpoint=none", *overrides)
    line = refused_cleanly(tmp_path, result, named, f"the largest: {largest}", "optimizer state")
    assert "RLIMIT_AS" in line  # the memory there is, and where that number comes from


@pytest.mark.parametrize(
    "override, message",
    [
        ("task.hidden=[1e8]", "task.hidden=[100000000.0]: expected a list of integers >= 1"),
        ("task.out_dim=1e9", "task.out_dim=1000000000.0: expected an integer >= 1"),
    ],
)
def test_sizes_given_as_floats_are_refused_as_ints_are(tmp_path, override, message):
    refused_cleanly(tmp_path, train_capped(tmp_path, "task=mlp", override), message)


def test_the_default_run_passes_under_the_same_limit(tmp_path):
    result = train_capped(tmp_path, "trainer.steps=3")
    assert result.returncode == 0, result.stderr[-4000:]


def test_activations_too_large_for_the_memory_are_refused_before_the_first_step(tmp_path):
    """Params of kilobytes, but attention scores of gigabytes: the state passes the shape
    check, and the compiled step's own memory analysis refuses the run before it runs."""
    result = train_capped(
        tmp_path,
        "task=tiny_gpt",
        "task.seq_len=4096",
        "task.d_model=32",
        "task.n_layers=1",
        "trainer.batch_size=64",
        "trainer.steps=2",
        "checkpoint=none",
    )
    line = refused_cleanly(tmp_path, result, "trainer.batch_size=64: a compiled step needs")
    assert "activations" in line
