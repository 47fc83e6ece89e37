"""A user's experiment repo composes the whole trainer config and keeps the exit statuses.

Its primary config starts from ``xshard_train`` and states only what differs. It runs through
``python -m trainers.train --config-dir ... --config-name ...`` and through the user's own
``@hydra.main`` calling `trainers.run`: both exit 0 / 2 / 3 with one line, as documented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli import run_train, scalars

pytestmark = pytest.mark.slow

REPO_FILES = {
    # Only what differs from xshard_train: the task, the mesh, a few trainer keys.
    "conf/my_exp.yaml": """\
        defaults:
          - xshard_train
          - override task: mlp
          - override mesh: cpu8
          - override checkpoint: none
          - _self_

        task:
          hidden: [32]
        trainer:
          steps: 3
          batch_size: 16
          eval_every: 2
          eval_batches: 1
          progress: false
    """,
    # An experiment file on top of it, with a bad value of the user's own making.
    "conf/bad_exp.yaml": """\
        defaults:
          - my_exp
          - _self_

        trainer:
          eval_every: -1
    """,
    "app.py": """\
        import hydra

        import trainers


        @hydra.main(config_path="conf", config_name="my_exp", version_base="1.3")
        def main(cfg):
            value = trainers.run(cfg)
            print(f"OBJECTIVE {value!r}", flush=True)
            return value


        if __name__ == "__main__":
            main()
    """,
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("my_repo")
    for rel, text in REPO_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    return lines[0]


def run_app(repo: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "app.py", *overrides],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_trainers_train_with_the_users_config_dir(repo, tmp_path):
    run = tmp_path / "run"
    run_train(
        f"--config-dir={repo / 'conf'}",
        "--config-name=my_exp",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["last_step"] == 3
    assert sorted(scalars(run / "tb", "eval/loss")) == [2, 3]
    composed = (run / ".hydra" / "config.yaml").read_text()
    assert "hidden:\n  - 32" in composed  # the user's value over the task option's
    assert "_target_: optax.adamw" in composed  # everything else from xshard_train

    bad = run_train(
        f"--config-dir={repo / 'conf'}",
        "--config-name=my_exp",
        "trainer.steps=-2",
        f"hydra.run.dir={tmp_path / 'bad'}",
        cwd=tmp_path,
        check=False,
    )
    assert "trainer.steps=-2: expected an integer" in one_error_line(bad, 2)

    from_file = run_train(
        f"--config-dir={repo / 'conf'}",
        "--config-name=bad_exp",
        f"hydra.run.dir={tmp_path / 'bad_file'}",
        cwd=tmp_path,
        check=False,
    )
    assert "trainer.eval_every=-1: expected an integer" in one_error_line(from_file, 2)


def test_users_own_hydra_main_keeps_the_exit_statuses(repo):
    ok = run_app(repo, "hydra.run.dir=runs/ok", "trainer.objective=eval/loss")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    result = json.loads((repo / "runs" / "ok" / "result.json").read_text())
    objective = float(ok.stdout.split("OBJECTIVE ", 1)[1].split()[0])
    assert objective == result["objective"] == result["eval"]["eval/loss"]

    bad = run_app(repo, "hydra.run.dir=runs/bad", "trainer.batch_size=abc")
    assert "trainer.batch_size='abc': expected an integer" in one_error_line(bad, 2)
    assert "OBJECTIVE" not in bad.stdout

    diverged = run_app(
        repo,
        "hydra.run.dir=runs/nan",
        "task.nan_at_step=[0]",
        "reduction.skip_nonfinite=false",
    )
    assert "Non-finite loss nan at step 1" in one_error_line(diverged, 3)
    result = json.loads((repo / "runs" / "nan" / "result.json").read_text())
    assert result["status"] == "diverged" and result["eval"] is None
