"""Paths as a user types them, through the real CLI from another working directory (slow):
``python -m trainers.evaluate``, `trainers.load`, ``trainer.resume_from`` and a relative
``hydra.run.dir`` resumed, each with a relative, a ``~`` (HOME set to a temp dir) and a ``..``
path; ``hydra.job.chdir=true`` changes into the run dir, and the paths still mean where they
were typed (trainers/rundir/user_paths.py). Before, Orbax refused the relative path and the
refusal was reported as a corrupted checkpoint with advice to fall back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli import run_train

pytestmark = pytest.mark.slow
STEPS = 4
TRAIN = (
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    "checkpoint.every_steps=2",
    "hydra.job.chdir=true",  # the job runs in its run dir: relative paths must not follow it
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """``<root>/runs/a``: a run started as ``hydra.run.dir=runs/a`` from `root`; ``<root>/sub``:
    another working directory."""
    root = tmp_path_factory.mktemp("user_paths")
    run_train(*TRAIN, f"trainer.steps={STEPS}", "hydra.run.dir=runs/a", cwd=root)
    (root / "sub").mkdir()
    return root


def forms(root: Path) -> list[tuple[str, Path, dict[str, str]]]:
    """(path as typed, the directory it is typed in, env) for ``runs/a`` of `root`."""
    home = {"HOME": str(root)}
    return [("runs/a", root, {}), ("../runs/a", root / "sub", {}), ("~/runs/a", root / "sub", home)]


def python(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("form", [0, 1, 2], ids=["relative", "dotdot", "home"])
def test_evaluate_reads_the_run_dir_where_it_was_typed(root, form):
    typed, cwd, env = forms(root)[form]
    result = python("-m", "trainers.evaluate", typed, "step=2", cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    written = root / "runs" / "a" / "eval_step2.json"
    assert f"wrote {written}" in result.stdout
    assert json.loads(written.read_text())["step"] == 2
    assert "corrupted" not in result.stderr and "changed config" not in result.stderr


def test_load_resolves_against_the_working_directory_at_the_call(root):
    script = textwrap.dedent(
        f"""
        import os, trainers
        steps = [trainers.load("../runs/a").step, trainers.load("~/runs/a", step=2).step]
        os.chdir({str(root)!r})  # the working directory at the call, not at import
        steps.append(trainers.load("runs/a").step)
        print("steps", steps)
        """
    )
    env = {"HOME": str(root), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = python("-c", script, cwd=root / "sub", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"steps [{STEPS}, 2, {STEPS}]" in result.stdout


@pytest.mark.parametrize("form", [0, 1, 2], ids=["relative", "dotdot", "home"])
def test_resume_from_is_read_where_it_was_typed_not_in_the_run_dir(root, form):
    typed, cwd, env = forms(root)[form]
    out = f"resumed_{form}"
    proc = run_train(
        *TRAIN,
        f"trainer.steps={STEPS + 2}",
        f"trainer.resume_from='{typed}'",  # quoted: Hydra's grammar refuses a bare ~
        f"hydra.run.dir={out}",
        cwd=cwd,
        env=env,
    )
    source = root / "runs" / "a" / "checkpoints" / str(STEPS)
    assert f"Restored step {STEPS} from {source}." in proc.stdout + proc.stderr
    assert (cwd / out / "checkpoints" / str(STEPS + 2)).is_dir()


def test_a_relative_run_dir_is_resumed_from_another_working_directory(root):
    """``hydra.run.dir=../runs/b`` from ``sub``: the rerun resumes the run's own checkpoint."""
    run_train(*TRAIN, "trainer.steps=2", "hydra.run.dir=../runs/b", cwd=root / "sub")
    proc = run_train(*TRAIN, "trainer.steps=4", "hydra.run.dir=../runs/b", cwd=root / "sub")
    own = root / "runs" / "b" / "checkpoints"
    assert f"Restored step 2 from {own / '2'}." in proc.stdout + proc.stderr
    assert (own / "4").is_dir()
