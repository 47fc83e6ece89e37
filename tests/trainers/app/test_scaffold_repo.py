"""`python -m trainers.new`, as a newcomer meets it: run from the installed wheel in another
directory, the repo it writes is installed (editable, as its `make install` does) into the
wheel's fresh virtual environment, then its own `make train` (a few steps, in bfloat16 with
every layer rematerialised), `make sweep`, `make test` and `python -m trainers.evaluate` on its
run, which its entry point allows without a flag.

The venv and the wheel are tests/test_packaging.py's fixtures; the dependencies come from this
environment, so `make install`'s resolution is the one step done by pip here with --no-deps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import ONE_PATH

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.wheel]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`cmd` in `cwd` (no PYTHONPATH: the repo's package comes from the venv); exit 0 or fail."""
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def repo(venv_python, tmp_path_factory) -> Path:
    """`python -m trainers.new lm-study` from the wheel, installed editable into its venv."""
    work = tmp_path_factory.mktemp("newcomer")
    proc = run([str(venv_python), "-m", "trainers.new", "lm-study"], cwd=work)
    root = work / "lm-study"
    assert f"(package lm_study) to {root}" in proc.stdout
    run(
        [
            sys.executable, "-m", "pip", "--python", str(venv_python), "install", "--quiet",
            "--no-deps", "-e", str(root),
        ],
        cwd=work,
    )  # fmt: skip
    return root


def make(python: Path, repo: Path, target: str, args: str = "") -> subprocess.CompletedProcess:
    """`make TARGET PYTHON=<the venv's python> ARGS=...` in the generated repo."""
    return run(["make", target, f"PYTHON={python}", f"ARGS={args}"], cwd=repo)


def make_runs(python: Path, repo: Path, target: str, args: str) -> subprocess.CompletedProcess:
    """`make` of a target that trains: on one gradient path (tests/cli.py's `ONE_PATH`), so
    that no run pays the default's start-up race of both paths."""
    return make(python, repo, target, f"{ONE_PATH} {args}")


def test_the_repo_has_what_the_scaffold_promises(repo):
    files = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file())
    for rel in ("pyproject.toml", "Makefile", "train.py", "conf/train.yaml", "conf/sweep.yaml",
                "conf/experiment/small.yaml", "conf/task/regression.yaml",
                "lm_study/models.py", "lm_study/data.py", "tests/test_train.py"):  # fmt: skip
        assert rel in files, files
    assert not any("my_experiments" in (repo / f).read_text() for f in files if "egg" not in f)


def test_make_train_a_few_steps_in_bf16_with_remat(venv_python, repo):
    args = "trainer.steps=6 trainer.eval_every=3 precision=bf16 trainer.remat=full"
    make_runs(venv_python, repo, "train", f"{args} hydra.run.dir=runs/smoke")
    run_dir = repo / "runs" / "smoke"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["last_step"] == 6, result
    assert result["eval"]["eval/loss"] > 0 and result["objective"] == result["eval"]["eval/loss"]
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "lm_study.models.MLP" in config and "allowed_targets" not in config  # the entry point

    # Its own run loads without +allowed_targets: the installed package's entry point.
    # (An absolute path: relative run dirs are issue 37's first item, tested where it is fixed.)
    proc = run([str(venv_python), "-m", "trainers.evaluate", str(run_dir)], cwd=repo)
    assert proc.stdout.startswith("step 6: eval/loss="), proc.stdout


def test_make_sweep_runs_the_grid(venv_python, repo):
    proc = make_runs(venv_python, repo, "sweep", "trainer.steps=2 hydra.sweep.dir=sweep")
    results = [json.loads(p.read_text()) for p in sorted((repo / "sweep").glob("*/result.json"))]
    assert len(results) == 4 and all(r["status"] == "completed" for r in results), proc.stdout
    assert "4 jobs: 4 completed" in (repo / "sweep" / "sweep_summary.md").read_text()


def test_make_test_passes(venv_python, repo):
    proc = make(venv_python, repo, "test")
    assert "4 passed" in proc.stdout, proc.stdout[-3000:]
