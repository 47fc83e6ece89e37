"""docs/tasks.md's "bring your own model" example runs as written, through the real CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import run_train, scalars

DOC = REPO / "docs" / "tasks.md"


def _block(language: str, first_line: str) -> str:
    for body in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no {language} block starting with {first_line!r} in {DOC}")


@pytest.mark.slow
def test_the_documented_pure_jax_task_trains(tmp_path):
    repo = tmp_path / "my_repo"
    (repo / "conf" / "task").mkdir(parents=True)
    (repo / "my_tasks.py").write_text(_block("python", "# my_repo/my_tasks.py"))
    (repo / "conf" / "task" / "linreg.yaml").write_text(
        _block("yaml", "# my_repo/conf/task/linreg.yaml")
    )
    (repo / "conf" / "my_exp.yaml").write_text(_block("yaml", "# my_repo/conf/my_exp.yaml"))
    run = tmp_path / "run"
    run_train(
        f"--config-dir={repo / 'conf'}",
        "--config-name=my_exp",
        "trainer.steps=20",
        "trainer.batch_size=16",
        "checkpoint=none",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(repo)},
    )
    mse = scalars(run / "tb", "train/mse")
    assert mse[20] < mse[min(mse)]  # it learns


def _flax_repo(tmp_path: Path, option: str) -> Path:
    """my_repo as docs/tasks.md writes it: my_models.py, the task option, a primary config."""
    repo = tmp_path / "my_repo"
    (repo / "conf" / "task").mkdir(parents=True)
    (repo / "my_models.py").write_text(_block("python", "# my_repo/my_models.py"))
    (repo / "conf" / "task" / f"{option}.yaml").write_text(
        _block("yaml", f"# my_repo/conf/task/{option}.yaml")
    )
    (repo / "conf" / "my_exp.yaml").write_text(
        "defaults:\n  - xshard_train\n  - override /task: "
        f"{option}\n  - _self_\n\nallowed_targets: [my_models.]\n"
    )
    return repo


@pytest.mark.parametrize("option", ["my_nnx", "my_linen"])
def test_the_documented_flax_models_follow_precision_and_remat(tmp_path, option, monkeypatch):
    """The documented model and node take the run's precision and trainer.remat as written."""
    pytest.importorskip("flax")
    from hydra import compose, initialize_config_dir

    from trainers.app.builders import build_task
    from trainers.tasks.flax_nnx import _takes

    repo = _flax_repo(tmp_path, option)
    monkeypatch.syspath_prepend(str(repo))
    with initialize_config_dir(str(repo / "conf"), version_base="1.3"):
        cfg = compose("my_exp", overrides=["precision=bf16", "trainer.remat=full"])
    task = build_task(cfg)
    wanted = {"dtype": "bfloat16", "param_dtype": "float32", "remat": "full"}
    if option == "my_nnx":  # what the factory is called with
        assert task.model_options(_takes(task.model)) == wanted
    else:  # the linen module's fields, set by the task
        assert {key: getattr(task.model, key) for key in wanted} == wanted


@pytest.mark.slow
@pytest.mark.parametrize("option", ["my_nnx", "my_linen"])
def test_the_documented_flax_models_train(tmp_path, option):
    pytest.importorskip("flax")
    repo = _flax_repo(tmp_path, option)
    run = tmp_path / "run"
    run_train(  # the model in bfloat16, each layer rematerialised: the node's three lines
        f"--config-dir={repo / 'conf'}",
        "--config-name=my_exp",
        "mesh=cpu4x2",
        "precision=bf16",
        "trainer.remat=full",
        "trainer.steps=40",
        "trainer.batch_size=16",
        "trainer.log_every=1",
        "schedule=constant",
        "optimizer.learning_rate=1e-2",
        "checkpoint=none",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(repo)},
    )
    mse = scalars(run / "tb", "train/mse")
    first, last = [mse[s] for s in range(1, 6)], [mse[s] for s in range(36, 41)]
    assert sum(last) < 0.5 * sum(first)  # it learns
