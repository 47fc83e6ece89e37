"""`python -m trainers.new DIR`: what it writes, where, and what it refuses (exit 2, one line,
nothing written). The written repo installed, trained and tested: test_scaffold_repo.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import refused
from trainers.app.scaffold import TEMPLATE_PACKAGE, render
from trainers.exits import EXIT_CONFIG_ERROR
from trainers.new import main

EXAMPLE = REPO / "examples" / "experiment_repo"
#: The files the scaffold and examples/experiment_repo share: one text, checked here.
SHARED = (
    "train.py",
    "my_experiments/models.py",
    "my_experiments/data.py",
    "conf/task/regression.yaml",
    "conf/experiment/small.yaml",
)


def new(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m trainers.new ARGS` in `cwd`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "trainers.new", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def test_the_scaffold_and_the_example_repo_share_their_model_data_task_and_app():
    files = render(TEMPLATE_PACKAGE)
    for rel in SHARED:
        assert files[rel] == (EXAMPLE / rel).read_text(), f"{rel} differs from the example's"


def test_writes_the_repo_relative_to_the_working_dir(tmp_path):
    proc = new("studies/lm-study", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "studies" / "lm-study"
    assert f"(package lm_study) to {root}" in proc.stdout
    files = tree(root)
    assert files == render("lm_study")
    assert {".gitignore", "Makefile", "lm_study/models.py", "tests/test_train.py"} <= set(files)
    assert not any("my_experiments" in text or "my-experiments" in text for text in files.values())
    pyproject = files["pyproject.toml"]
    assert 'name = "lm-study"' in pyproject and '"xshard[flax,grain]"' in pyproject
    assert '[project.entry-points."xshard.allowed_targets"]\nlm_study = "lm_study"' in pyproject
    assert "  - xshard_train\n" in files["conf/train.yaml"]
    task = files["conf/task/regression.yaml"]
    assert "_target_: lm_study.models.MLP" in task and "remat: ${trainer.remat}" in task
    for target in ("install:", "train:", "sweep:", "test:"):
        assert f"\n{target}" in files["Makefile"]


def test_writes_into_an_empty_dir_with_a_package_name(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["empty", "--package", "lm"]) == 0
    assert (tmp_path / "empty" / "lm" / "data.py").is_file()
    assert "(package lm)" in capsys.readouterr().out


def test_refuses_a_dir_with_files_and_touches_nothing(tmp_path):
    mine = tmp_path / "mine"
    (mine / "conf").mkdir(parents=True)
    (mine / "conf" / "train.yaml").write_text("my own\n")
    line = refused(new("mine", cwd=tmp_path), f"{mine} is not empty", "never over files")
    assert line.startswith("xshard: error: ")
    assert tree(mine) == {"conf/train.yaml": "my own\n"}


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["My Study"], ["'My Study'", "is not a package name", "--package NAME"]),
        (["x", "--package", "class"], ["'class'", "(--package) is not a package name"]),
        (["x", "--package=9lm"], ["'9lm'", "starting with a letter"]),
        (["os"], ["'os'", "is taken by a module"]),
        (["x", "--package", "trainers"], ["'trainers'", "is taken by a module"]),
        (["x", "--package", "train"], ["'train'", "its own files"]),  # train.py
        (["a-file"], ["exists and is not a dir"]),
        ([], ["expected one DIR, got 0", "usage: python -m trainers.new"]),
        (["x", "y"], ["expected one DIR, got 2"]),
        (["x", "--force"], ["unknown option '--force'"]),
        (["x", "--package"], ["--package needs a name"]),
    ],
)
def test_refuses_a_bad_target_or_name_with_one_line(tmp_path, capsys, monkeypatch, args, fragments):
    (tmp_path / "a-file").write_text("mine\n")
    monkeypatch.chdir(tmp_path)
    assert main(args) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("xshard: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written
