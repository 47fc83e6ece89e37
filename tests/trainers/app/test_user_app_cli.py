"""A user's experiment repo with its own ``@hydra.main`` calling `trainers.run`, as
docs/config.md recommends: ``--help`` works there (and never imports JAX), ``--cfg job
--resolve`` prints the resolved config, ``+allowed_targets=[...]`` adds to the primary config's
list, and TensorBoard run folders have clean names.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests import REPO

pytestmark = pytest.mark.slow

REPO_FILES = {
    "conf/my_exp.yaml": """\
        defaults:
          - xshard_train
          - override task: mlp
          - override mesh: cpu8
          - override checkpoint: none
          - _self_

        task:
          _target_: my_tasks.Tiny
          hidden: [8]
        trainer:
          steps: 2
          batch_size: 16
          progress: false
        allowed_targets: [my_tasks.]
    """,
    "my_tasks.py": """\
        from trainers.tasks.mlp import MLPTask


        class Tiny(MLPTask):
            \"\"\"The built-in MLP, as a task of the user's own package.\"\"\"
    """,
    "my_hooks.py": """\
        import trainers


        class Steps(trainers.Hook):
            \"\"\"Counts the steps it saw into a file.\"\"\"

            def __init__(self, path):
                self.path, self.steps = path, []

            def on_step(self, step, metrics):
                self.steps.append(step)

            def on_end(self, step, state, reason):
                with open(self.path, "w") as f:
                    f.write(" ".join(map(str, self.steps)))
    """,
    "train.py": """\
        import hydra

        import trainers


        @hydra.main(config_path="conf", config_name="my_exp", version_base="1.3")
        def main(cfg):
            return trainers.run(cfg)


        if __name__ == "__main__":
            main()
    """,
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user_repo")
    for rel, text in REPO_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def run(repo: Path, *args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": f"{repo}{os.pathsep}{REPO}"}
    return subprocess.run(
        [sys.executable, *python_flags, *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reported importing."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize("entry", [["train.py"], ["-m", "trainers.train"]], ids=["user", "cli"])
def test_help_works_in_the_users_app_and_imports_no_jax(repo, entry):
    result = run(repo, *entry, "--help", python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Exit status of a single run" in result.stdout
    assert "logger: " in result.stdout  # the config groups are listed
    modules = imported_modules(result.stderr)
    assert "hydra" in modules  # the importtime report is there
    assert not any(m == "jax" or m.startswith("jax.") for m in modules)


def test_cfg_job_resolve_prints_the_resolved_config(repo):
    result = run(repo, "train.py", "--cfg", "job", "--resolve", "task.hidden=[4, 4]")
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = yaml.safe_load(result.stdout)
    tb_dir = Path(cfg["paths"]["tb_dir"])
    assert tb_dir.parent.name == "tb" and tb_dir.parts[0] == "outputs"
    assert tb_dir.name == "hidden=[4,4]"  # short, and no spaces, braces or quotes
    assert cfg["trainer"]["steps"] == 2


def test_command_line_allowed_targets_add_to_the_primary_configs(repo, tmp_path):
    steps = tmp_path / "steps.txt"
    result = run(
        repo,
        "train.py",
        "+allowed_targets=[my_hooks.]",
        f"trainer.hooks=[{{_target_:my_hooks.Steps,path:'{steps}'}}]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert steps.read_text() == "1 2"  # my_tasks.Tiny (primary) and my_hooks.Steps (CLI) ran
    log = (tmp_path / "run" / "train.log").read_text()
    assert "'my_tasks.'" in log and "'my_hooks.'" in log  # the active prefixes
