"""Checkpoints put to use through the real CLI (slow): ``python -m trainers.evaluate`` on a
real run dir (latest and ``step=``), `trainers.load` in a process with one CPU device,
``--export`` read back with plain NumPy bitwise, and a forged run dir refused with exit 2
before anything of it runs (trainers/evaluate.py, trainers/app/checkpoint_use.py,
trainers/app/run_dir_config.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from tests import REPO
from tests.cli import refused, run_train, scalars
from trainers.app.checkpoint_use import flat_params
from trainers.exits import EXIT_CONFIG_ERROR

pytestmark = pytest.mark.slow
STEPS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One real run: task=mlp (it has an eval split), checkpoints at steps 3 and 6."""
    root = tmp_path_factory.mktemp("evaluate")
    run_dir = root / "run"
    run_train(
        "task=mlp",
        "mesh=cpu8",
        "trainer.batch_size=16",
        f"trainer.steps={STEPS}",
        "checkpoint.every_steps=3",
        "checkpoint.keep=5",
        f"hydra.run.dir={run_dir}",
        cwd=root,
    )
    return run_dir


def evaluate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainers.evaluate", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def saved_params(step_dir: Path) -> dict[str, np.ndarray]:
    """The params of a checkpoint as Orbax reads them without a target, by parameter path."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
        tree = c.restore(step_dir, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return flat_params(jax.tree.map(np.asarray, tree["state"]["params"]))


def test_evaluate_latest_and_a_step(run):
    latest = evaluate(str(run))
    assert latest.returncode == 0, latest.stderr[-3000:]
    record = json.loads((run / f"eval_step{STEPS}.json").read_text())
    assert record["step"] == STEPS and record["examples"] > 0
    final = scalars(run / "tb", "eval/loss")[STEPS]  # the run's own final evaluation
    assert record["metrics"]["eval/loss"] == pytest.approx(final, rel=1e-6)
    assert f"step {STEPS}: eval/loss=" in latest.stdout

    earlier = evaluate(str(run), "step=3")
    assert earlier.returncode == 0, earlier.stderr[-3000:]
    loss3 = json.loads((run / "eval_step3.json").read_text())["metrics"]["eval/loss"]
    assert loss3 != record["metrics"]["eval/loss"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["step=4"], "has no complete checkpoint of step=4; its steps: [3, 6]"),
        (["step=x"], "step='x': expected a checkpoint step"),
        (["--bogus"], "unknown option '--bogus'"),
    ],
)
def test_bad_step_or_option_is_one_line_exit_2(run, args, fragment):
    refused(evaluate(str(run), *args), fragment)


def test_not_a_run_dir_is_one_line_exit_2(tmp_path):
    refused(evaluate(str(tmp_path / "missing")), "no such directory")
    refused(evaluate(str(tmp_path)), "is not a run dir of trainers.train: it has no .hydra")


def test_load_on_one_device_and_export_round_trip(run, tmp_path):
    out = tmp_path / "params.npz"
    script = textwrap.dedent(
        f"""
        import jax, numpy as np, trainers
        loaded = trainers.load({str(run)!r})
        assert len(jax.devices()) == 1, jax.devices()
        assert loaded.step == {STEPS} and loaded.config.task._target_.endswith("MLPTask")
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(loaded.params))
        trainers.export_params(loaded.params, {str(out)!r})
        print("loaded", sorted(np.load({str(out)!r}).files))
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = dict(np.load(out))  # plain NumPy, no xshard
    want = saved_params(run / "checkpoints" / str(STEPS))
    assert exported.keys() == want.keys() and len(want) >= 2
    for key, value in want.items():
        assert exported[key].dtype == value.dtype and exported[key].tobytes() == value.tobytes()


def test_export_from_the_cli(run, tmp_path):
    out = tmp_path / "cli_params.npz"
    proc = evaluate(str(run), "step=3", "--export", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, want = dict(np.load(out)), saved_params(run / "checkpoints" / "3")
    assert all(exported[k].tobytes() == v.tobytes() for k, v in want.items())


@pytest.mark.parametrize(
    ("forged", "fragment"),
    [
        ({"task": {"_target_": "os.system", "command": "touch {pwned}"}}, "os.system"),
        ({"allowed_targets": ["os."]}, "allows _target_s under 'os.'"),
        ({"hydra": {"callbacks": {"x": {"_target_": "os.system"}}}}, "sets hydra.callbacks"),
    ],
)
def test_a_forged_run_dir_is_refused_and_nothing_runs(run, tmp_path, forged, fragment):
    copy = tmp_path / "copied"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("eval_step*.json"))
    pwned = tmp_path / "pwned"
    config = yaml.safe_load((copy / ".hydra" / "config.yaml").read_text())
    text = json.dumps(forged).replace("{pwned}", str(pwned))
    for key, value in json.loads(text).items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    if "allowed_targets" in forged:
        config["task"] = {"_target_": "os.system", "command": f"touch {pwned}"}
    (copy / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    result = evaluate(str(copy))
    assert result.returncode == EXIT_CONFIG_ERROR
    refused(result, fragment)
    assert not pwned.exists() and not list(copy.glob("eval_step*.json"))


@pytest.fixture(scope="module")
def nnx_run(tmp_path_factory) -> Path:
    """A run of the built-in Flax NNX task (no ``apply``: the module is merged instead)."""
    root = tmp_path_factory.mktemp("evaluate_nnx")
    run_train(
        "task=flax_nnx",
        "mesh=cpu8",
        "trainer.batch_size=16",
        "trainer.steps=2",
        f"hydra.run.dir={root / 'run'}",
        cwd=root,
    )
    return root / "run"


@pytest.mark.parametrize(
    ("which", "target"),
    [("run", "trainers.tasks.mlp.MLPTask"), ("nnx_run", "trainers.tasks.flax_nnx.NNXTask")],
)
def test_the_documented_load_and_export_example_runs(request, tmp_path, which, target):
    run = request.getfixturevalue(which)
    step = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    doc = (REPO / "docs" / "tasks.md").read_text()
    blocks = re.findall(r"```python\n(# load_and_export\.py.*?)```", doc, flags=re.S)
    assert len(blocks) == 1
    (tmp_path / "load_and_export.py").write_text(blocks[0])
    proc = subprocess.run(
        [sys.executable, "load_and_export.py", str(run)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{step} {target}")
    assert "nan" not in proc.stdout.lower()  # the model's outputs on two examples
    assert sorted(np.load(tmp_path / "params.npz").files) == sorted(
        saved_params(run / "checkpoints" / str(step))
    )
