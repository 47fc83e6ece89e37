"""A periodic run's checkpoint put to use (slow): `trainers.load` on one CPU device returns the
outer params (the replicas' last agreed params, not a replica's), and ``python -m
trainers.evaluate`` on the run's mesh scores them as the run's own final evaluation did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.cli import run_train, scalars
from tests.multihost_cli import load_arrays

pytestmark = pytest.mark.slow
STEPS = 5  # syncs at 2 and 4: at 5 the replicas have moved off the outer params


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """DiLoCo with int8 pseudo-gradients (per-replica residuals) on mesh=cpu2x4_slices."""
    root = tmp_path_factory.mktemp("periodic_evaluate")
    run_dir = root / "run"
    run_train(
        "task=mlp",
        "mesh=cpu2x4_slices",
        "schedule=constant",
        "trainer.batch_size=16",
        "reduction=diloco_int8",
        "reduction.axes.slice.every_steps=2",
        f"trainer.steps={STEPS}",
        "checkpoint.async_save=false",
        f"hydra.run.dir={run_dir}",
        cwd=root,
    )
    return run_dir


def test_load_on_one_device_gives_the_outer_params(run, tmp_path):
    out = tmp_path / "params.npz"
    script = textwrap.dedent(
        f"""
        import jax, numpy as np, trainers
        loaded = trainers.load({str(run)!r})
        assert len(jax.devices()) == 1, jax.devices()
        assert loaded.step == {STEPS}
        np.savez({str(out)!r}, *jax.tree.leaves(loaded.params))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = np.load(out)
    saved = load_arrays(run / "checkpoints" / str(STEPS))
    outer = [saved[f"['outer']['params'][0][{i}]"] for i in range(len(loaded.files))]
    replica = [v for k, v in saved.items() if k.startswith("['params']")]
    assert len(outer) == len(replica) == 6
    for i, want in enumerate(outer):
        np.testing.assert_array_equal(loaded[f"arr_{i}"], want)
    # The replicas trained one step alone after the last sync: not what load returns.
    assert not np.array_equal(replica[0][0], outer[0])


def test_evaluate_scores_the_outer_params_as_the_run_did(run):
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.evaluate", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run / f"eval_step{STEPS}.json").read_text())
    final = scalars(run / "tb", "eval/loss")[STEPS]  # the run's own evaluation, outer params
    assert record["metrics"]["eval/loss"] == pytest.approx(final, rel=1e-6)
