"""optimizer=muon, schedule_free_adamw and adopt through the real CLI (slow): each composes and
trains a few steps, a bad value is one line and exit 2, and a schedule-free run's checkpoint
is loaded (`trainers.load`), exported and evaluated at its evaluation params
(``optax.contrib.schedule_free_eval_params``), not the raw params it trains."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.cli import refused, run_train, scalars
from tests.multihost_cli import load_arrays

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.mark.parametrize(
    "overrides",
    [
        ("optimizer=muon",),  # tiny_gpt: Muon for its hidden matrices, Adam for the rest
        ("optimizer=adopt", "task=mlp"),
        ("optimizer=schedule_free_adamw", "task=mlp"),
    ],
    ids=["muon", "adopt", "schedule_free_adamw"],
)
def test_each_option_trains_from_the_cli(overrides, tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        *overrides,
        "schedule=constant",
        "optimizer.learning_rate=1e-2",
        "trainer.steps=10",
        "trainer.log_every=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    losses = scalars(run_dir / "tb", "train/loss")
    assert sorted(losses) == list(range(1, 11)) and all(math.isfinite(v) for v in losses.values())
    assert losses[10] < 0.9 * losses[1]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (("optimizer=muon", "optimizer.muon_mask=all"), ["optimizer.muon_mask='all'", "hidden"]),
        (("optimizer=muon", "optimizer.ns_steps=0"), ["optimizer.ns_steps=0: expected"]),
        (("optimizer=muon", "optimizer.preconditioning=svd"), ["'svd'", "'frobenius'"]),
        (("optimizer=muon", "optimizer.adam_b2=1.5"), ["optimizer.adam_b2=1.5: expected"]),
        (("optimizer=adopt", "optimizer.b2=1"), ["optimizer.b2=1.0: expected"]),
        (("optimizer=schedule_free_adamw", "schedule=constant", "optimizer.b1=0"), ["b1=0"]),
        (
            ("optimizer=schedule_free_adamw", "trainer.steps=1000"),  # the default warmup_cosine
            ["schedule._target_='xshard.schedules.warmup_cosine' decays", "schedule=constant"],
        ),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(overrides, fragments, tmp_path):
    result = run_train(
        "task=mlp", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False
    )
    refused(result, *fragments)


@pytest.fixture(scope="module")
def schedule_free_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("schedule_free")
    run_dir = root / "run"
    run_train(
        "task=mlp",
        "optimizer=schedule_free_adamw",
        "schedule=constant",
        "optimizer.learning_rate=0.05",
        f"trainer.steps={STEPS}",
        "checkpoint.async_save=false",
        f"hydra.run.dir={run_dir}",
        cwd=root,
    )
    return run_dir


def eval_and_raw_params(step_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """From the checkpoint's arrays: schedule_free_eval_params (x = (y - (1 - b1) z) / b1),
    and the raw params y, by parameter path."""
    saved = load_arrays(step_dir)
    sf = "['opt_state']['inner_state']['inner_state']"
    b1 = saved[f"{sf}['b1']"]
    raw = {k[len("['params']") :]: v for k, v in saved.items() if k.startswith("['params']")}
    x = {k: (y - (1.0 - b1) * saved[f"{sf}['z']{k}"]) / b1 for k, y in raw.items()}
    return x, raw


def path_of(key: str) -> str:
    """ "['layers'][0]['w']" -> "layers/0/w" (the export's keys)."""
    return "/".join(part.strip("'") for part in key.strip("[]").split("]["))


def test_load_and_export_give_the_schedule_free_eval_params(schedule_free_run, tmp_path):
    out = tmp_path / "params.npz"
    script = textwrap.dedent(
        f"""
        import trainers
        loaded = trainers.load({str(schedule_free_run)!r})
        assert loaded.step == {STEPS}
        trainers.export_params(loaded.params, {str(out)!r})
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli_out = tmp_path / "cli.npz"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.evaluate",
            str(schedule_free_run),
            "--export",
            str(cli_out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    x, raw = eval_and_raw_params(schedule_free_run / "checkpoints" / str(STEPS))
    for exported in (dict(np.load(out)), dict(np.load(cli_out))):
        assert sorted(exported) == sorted(path_of(k) for k in x) and len(x) == 6
        for key, want in x.items():
            np.testing.assert_allclose(exported[path_of(key)], want, rtol=1e-6, atol=1e-7)
            assert not np.allclose(exported[path_of(key)], raw[key], rtol=1e-3, atol=1e-4), key


def test_evaluate_scores_the_eval_params_as_the_run_did(schedule_free_run):
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.evaluate", str(schedule_free_run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((schedule_free_run / f"eval_step{STEPS}.json").read_text())
    final = scalars(schedule_free_run / "tb", "eval/loss")[STEPS]
    assert record["metrics"]["eval/loss"] == pytest.approx(final, rel=1e-6)
