"""The wheel ships the configs and the Hydra plugin; another repo composes with them.

Builds the wheel from a copy of the working tree, checks its contents against the tree on disk,
installs it (and only it: dependencies come from this environment through a .pth file) into a
fresh virtual environment, then runs small Hydra apps of a separate "experiment repo" whose
own configs compose ``xshard_train`` and extend its groups through the SearchPathPlugin,
including a multirun, and one that trains through `trainers.run`.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.wheel_fixtures import PACKAGE_DIRS, run_app

pytestmark = [pytest.mark.slow, pytest.mark.wheel]


def test_wheel_contents(wheel, source):
    names = set(zipfile.ZipFile(wheel).namelist())
    yamls = sorted(
        p.relative_to(source / "conf").as_posix() for p in (source / "conf").rglob("*.yaml")
    )
    assert yamls, "no YAML under conf/"
    missing = [y for y in yamls if f"xshard/conf/{y}" not in names]
    assert not missing, f"YAML left out of the wheel: {missing}"
    assert "xshard/conf/__init__.py" in names

    assert "hydra_plugins/xshard_searchpath/xshard_searchpath.py" in names
    assert "xshard/config/schemas.py" in names
    assert "hydra_plugins/__init__.py" not in names  # a namespace shared by all Hydra plugins

    # Every module of the source tree, so that a new subpackage cannot be left out silently.
    modules = sorted(
        p.relative_to(source).as_posix()
        for d in PACKAGE_DIRS
        for p in (source / d).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    missing = [m for m in modules if m not in names]
    assert not missing, (
        f"modules left out of the wheel (pyproject [tool.setuptools] packages): {missing}"
    )

    # python -m trainers.new writes its repo from these (pyproject [tool.setuptools.package-data]).
    scaffold = source / "trainers" / "app" / "scaffold_files"
    templates = sorted(p.relative_to(source).as_posix() for p in scaffold.rglob("*.tmpl"))
    assert templates, "no scaffold templates"
    missing = [t for t in templates if t not in names]
    assert not missing, f"scaffold templates left out of the wheel: {missing}"


EXPERIMENT_REPO = {
    "conf/my_exp.yaml": """\
        # A user's primary config composes xshard's (from pkg://xshard.conf via the plugin)
        # and states only what differs.
        defaults:
          - xshard_train
          - override reduction: sum
          - _self_

        clip: 1.0
        trainer:
          steps: 50
    """,
    "conf/train_exp.yaml": """\
        # Training with xshard's trainer from the user's own @hydra.main (train_app.py).
        defaults:
          - xshard_train
          - override task: mlp
          - override mesh: cpu8
          - override checkpoint: none
          - _self_

        trainer:
          steps: 2
          batch_size: 16
          eval_batches: 1
          progress: false
    """,
    "train_app.py": """\
        import hydra

        import trainers


        @hydra.main(config_path="conf", config_name="train_exp", version_base="1.3")
        def main(cfg):
            value = trainers.run(cfg)
            print(f"OBJECTIVE {value!r} {trainers.__file__}", flush=True)
            return value


        if __name__ == "__main__":
            main()
    """,
    "conf/optimizer/my_adam.yaml": """\
        # The user's own option, extending xshard's adam.
        defaults:
          - adam
          - _self_

        learning_rate: 0.005
        b2: 0.95
    """,
    "app.py": """\
        import json

        import hydra
        import jax
        import jax.numpy as jnp

        import xshard


        @hydra.main(config_path="conf", config_name="my_exp", version_base="1.3")
        def main(cfg):
            tx = xshard.build_optimizer(cfg)
            params = {"w": jnp.ones((2, 2)), "b": jnp.zeros((2,))}
            state = tx.init(params)
            updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
            print("RESULT " + json.dumps({
                "target": cfg.optimizer._target_,
                "learning_rate": cfg.optimizer.learning_rate,
                "b2": cfg.optimizer.b2,
                "mode": cfg.reduction.mode,
                "decay_steps": cfg.schedule.decay_steps,
                "slots": xshard.get_slot_names(state),
                "finite": all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates)),
                "xshard_file": xshard.__file__,
            }), flush=True)


        if __name__ == "__main__":
            main()
    """,
}


@pytest.fixture(scope="module")
def experiment_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("experiment_repo")
    for rel, text in EXPERIMENT_REPO.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def results(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def test_wheel_installs_plugin_and_configs(venv_python, experiment_repo):
    proc = run_app(venv_python, experiment_repo, "--info", "searchpath")
    assert proc.returncode == 0, proc.stderr
    assert "pkg://xshard.conf" in proc.stdout and "xshard" in proc.stdout


def test_experiment_repo_run(venv_python, experiment_repo):
    (res,) = results(run_app(venv_python, experiment_repo))
    venv_root = venv_python.parent.parent
    assert Path(res["xshard_file"]).resolve().is_relative_to(venv_root.resolve()), res
    assert res["target"] == "optax.adamw" and res["mode"] == "sum" and res["decay_steps"] == 50
    assert res["finite"] and res["slots"] == ["mu", "nu"]

    (res,) = results(run_app(venv_python, experiment_repo, "optimizer=my_adam"))
    assert res["target"] == "optax.adam"
    assert res["learning_rate"] == 0.005 and res["b2"] == 0.95  # user's values over xshard's


def test_experiment_repo_schema_from_wheel(venv_python, experiment_repo):
    proc = run_app(venv_python, experiment_repo, "optimizer=my_adam", "optimizer.b2=high")
    assert proc.returncode != 0
    assert "Value 'high' of type 'str' could not be converted to Float" in proc.stderr


def test_experiment_repo_multirun(venv_python, experiment_repo):
    proc = run_app(
        venv_python,
        experiment_repo,
        "-m",
        "optimizer=adamw,my_adam",
        "reduction=sum,mean",
        "hydra.sweep.dir=multirun",
    )
    runs = results(proc)
    assert sorted((r["target"], r["mode"]) for r in runs) == [
        ("optax.adam", "mean"),
        ("optax.adam", "sum"),
        ("optax.adamw", "mean"),
        ("optax.adamw", "sum"),
    ]
    assert all(r["finite"] for r in runs)
    assert {r["learning_rate"] for r in runs if r["target"] == "optax.adam"} == {0.005}


def test_experiment_repo_trains_with_trainers_run(venv_python, experiment_repo):
    """The user's own @hydra.main calls `trainers.run` from the wheel: exit statuses kept."""
    ok = run_app(venv_python, experiment_repo, "hydra.run.dir=runs/ok", app="train_app.py")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    value, path = ok.stdout.split("OBJECTIVE ", 1)[1].split()[:2]
    result = json.loads((experiment_repo / "runs" / "ok" / "result.json").read_text())
    assert float(value) == result["objective"] and result["eval"]["eval/loss"] > 0
    assert Path(path).resolve().is_relative_to(venv_python.parent.parent.resolve())

    bad = run_app(
        venv_python, experiment_repo, "hydra.run.dir=runs/bad", "seed=-1", app="train_app.py"
    )
    assert bad.returncode == 2, bad.stdout[-3000:] + bad.stderr[-3000:]
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: seed=-1"), bad.stderr
