"""The ``_target_`` allowlist at the real CLI (subprocesses; all marked slow): known exploits
exit 2 with one line and run nothing; only the primary config or the command line may widen
``allowed_targets``; the active prefixes are logged in train.log."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from tests.cli import refused, run_train

COMMON = ["task=mlp", "mesh=cpu8", "trainer.batch_size=16", "checkpoint=none"]
WHOLE_PACKAGES = "+allowed_targets=[optax.,xshard.,trainers.]"


@pytest.mark.slow
@pytest.mark.parametrize("widened", [False, True], ids=["default", "whole-packages"])
def test_os_system_through_a_reexport_never_runs(tmp_path, widened):
    pwned = tmp_path / "pwned"
    result = run_train(
        *COMMON,
        "~task",
        f'+task={{_target_:trainers.app.preflight.os.system,command:"touch {pwned}"}}',
        *([WHOLE_PACKAGES] if widened else []),
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    refused(
        result,
        "task._target_='trainers.app.preflight.os.system' is not an allowed target",
        "is the module 'os'" if widened else "Allowed prefixes",
    )
    assert not pwned.exists()


@pytest.mark.slow
@pytest.mark.parametrize("widened", [False, True], ids=["default", "whole-packages"])
def test_rmtree_task_yaml_from_config_dir_never_runs(tmp_path, widened):
    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "keep.txt").write_text("precious")
    conf = tmp_path / "conf"
    (conf / "task").mkdir(parents=True)
    (conf / "task" / "wipe.yaml").write_text(
        f"_target_: trainers.checkpoint.resume.shutil.rmtree\npath: {victim}\n"
    )
    result = run_train(
        f"--config-dir={conf}",
        *COMMON,
        "task=wipe",
        *([WHOLE_PACKAGES] if widened else []),
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    refused(
        result, "task._target_='trainers.checkpoint.resume.shutil.rmtree' is not an allowed target"
    )
    assert (victim / "data" / "keep.txt").read_text() == "precious"


# path: fragment of the one-line error, with the whole packages allowed
REFUSED_TARGETS = {
    "builtins.eval": "Allowed prefixes",
    "trainers.train.__builtins__": "'__builtins__' is a private name",
    "trainers.tasks.mlp.MLPTask.__init__.__globals__": "'__init__' is a private name",
    "optax": "it is a module",
    "trainers.tasks.sharding.Mesh": "'jax._src.mesh.Mesh', defined outside",
}


@pytest.mark.slow
@pytest.mark.parametrize("target, message", REFUSED_TARGETS.items(), ids=REFUSED_TARGETS.keys())
def test_builtins_modules_dunders_and_reexports_are_refused(tmp_path, target, message):
    result = run_train(
        *COMMON,
        f"task._target_={target}",
        WHOLE_PACKAGES,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    refused(result, f"task._target_={target!r} is not an allowed target", message)


# --------------------------------------------------------------------------------------------
# Who may widen the allowlist
# --------------------------------------------------------------------------------------------


@pytest.fixture
def user_pkg(tmp_path) -> dict[str, str]:
    """A tiny package ``xs_mypkg`` defining a task; returns the env that puts it on the path."""
    pkg = tmp_path / "site" / "xs_mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from trainers.tasks.mlp import MLPTask\n\n\n"
        "class UserMLP(MLPTask):\n"
        "    def __init__(self, **kwargs):\n"
        "        print('UserMLP built')\n"
        "        super().__init__(**kwargs)\n"
    )
    path = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path))}


def logged_prefixes(run_dir: Path) -> str:
    lines = [
        line
        for line in (run_dir / "train.log").read_text().splitlines()
        if "Allowed _target_ prefixes:" in line
    ]
    assert len(lines) == 1, (run_dir / "train.log").read_text()
    return lines[0]


@pytest.mark.slow
def test_composed_experiment_file_cannot_widen_the_allowlist(tmp_path):
    pwned = tmp_path / "pwned"
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "evil.yaml").write_text(
        textwrap.dedent(f"""\
        # @package _global_
        allowed_targets: [os.]
        task:
          _target_: os.system
          command: touch {pwned}
        """)
    )
    result = run_train(
        f"--config-dir={conf}",
        *COMMON,
        "experiment=evil",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    refused(
        result,
        f"config file {conf / 'experiment' / 'evil.yaml'} sets allowed_targets",
        "may widen the allowlist",
    )
    assert not pwned.exists()


@pytest.mark.slow
def test_command_line_may_widen_the_allowlist(tmp_path, user_pkg):
    args = [*COMMON, "task._target_=xs_mypkg.UserMLP", "trainer.steps=2"]
    refused(
        run_train(
            *args, f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path, check=False, env=user_pkg
        ),
        "'+allowed_targets=[xs_mypkg.]' on the command line",
    )
    run = tmp_path / "run"
    result = run_train(
        *args, "+allowed_targets=[xs_mypkg.]", f"hydra.run.dir={run}", cwd=tmp_path, env=user_pkg
    )
    assert "UserMLP built" in result.stdout
    assert "'trainers.tasks.', 'xs_mypkg.']" in logged_prefixes(run)


@pytest.mark.slow
def test_the_environment_may_widen_the_allowlist(tmp_path, user_pkg):
    run = tmp_path / "run"
    env = {**user_pkg, "XSHARD_ALLOWED_TARGETS": "xs_mypkg."}
    args = [*COMMON, "task._target_=xs_mypkg.UserMLP", "trainer.steps=2", f"hydra.run.dir={run}"]
    result = run_train(*args, cwd=tmp_path, env=env)
    assert "UserMLP built" in result.stdout
    assert "'xs_mypkg.'" in logged_prefixes(run)


@pytest.mark.slow
def test_primary_config_may_widen_the_allowlist(tmp_path, user_pkg):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text(
        textwrap.dedent("""\
        defaults:
          - xshard_train
          - _self_
        allowed_targets: [xs_mypkg.]
        task:
          _target_: xs_mypkg.UserMLP
        """)
    )
    run = tmp_path / "run"
    result = run_train(
        f"--config-dir={conf}",
        "--config-name=mine",
        *COMMON,
        "trainer.steps=2",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env=user_pkg,
    )
    assert "UserMLP built" in result.stdout
    assert "'trainers.tasks.', 'xs_mypkg.']" in logged_prefixes(run)
