"""examples/experiment_repo, installed as a user would: our wheel and the example's own package
in a fresh virtual environment, then its own `train.py` (a `@hydra.main` calling
`trainers.run`) trains an experiment, runs the 2x2 sweep, and resumes after SIGTERM.

The venv and the wheel are tests/test_packaging.py's fixtures (the dependencies, flax and grain
among them, come from this environment). The example runs from a copy without its package
directory, so `my_experiments` can only be imported from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import REPO
from tests.cli import ONE_PATH, load_events, scalars
from tests.reliability_helpers import assert_bitwise_equal, load_state, wait_until
from tests.wheel_fixtures import run_app
from trainers.checkpoint.resume import complete_steps
from trainers.exits import EXIT_PREEMPTED

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.wheel]

EXAMPLE = REPO / "examples" / "experiment_repo"
STEPS = 120  # long enough (compile + ~4 s of steps) for a SIGTERM to land mid-run
# One gradient path (tests/cli.py's): no start-up race per run, and runs compared bitwise.
RUN = ["experiment=small", f"trainer.steps={STEPS}", ONE_PATH]


@pytest.fixture(scope="module")
def example(venv_python, tmp_path_factory) -> Path:
    """The example installed into the venv (not editable); returns a copy of its configs and
    train.py, without the package, to run in."""
    src = tmp_path_factory.mktemp("example_src") / "experiment_repo"
    shutil.copytree(
        EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun")
    )
    dist = src.parent / "dist"
    subprocess.run(  # as the wheel fixture builds ours
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = dist.glob("my_experiments-*.whl")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv_python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(whl),
        ],
        check=True,
        timeout=300,
    )
    requires = subprocess.run(
        [
            str(venv_python),
            "-c",
            "import importlib.metadata as m; print(m.requires('my-experiments'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "xshard[flax,grain]" in requires.replace(" ", ""), requires
    run_dir = tmp_path_factory.mktemp("example_run")
    shutil.copytree(src / "conf", run_dir / "conf")
    shutil.copy2(src / "train.py", run_dir / "train.py")
    return run_dir


def train(python: Path, repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in the example; fails the test unless it exits 0."""
    proc = run_app(python, repo, *args, app="train.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def hook_log(run: Path) -> list[dict]:
    """The records the example's custom hook (my_experiments.hooks.LossLog) wrote."""
    path = run / "loss_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def baseline(venv_python, example) -> Path:
    """experiment=small, uninterrupted."""
    train(venv_python, example, *RUN, "hydra.run.dir=runs/baseline")
    return example / "runs" / "baseline"


def test_example_trains_with_eval_and_its_hook(venv_python, example, baseline):
    result = json.loads((baseline / "result.json").read_text())
    assert result["status"] == "completed" and result["last_step"] == STEPS, result
    events = load_events(baseline / "tb")
    assert {"eval/loss", "eval/mse", "train/loss"} <= set(events.Tags()["scalars"])
    evals = scalars(baseline / "tb", "eval/loss")
    assert sorted(evals) == list(range(10, STEPS + 1, 10))  # experiment=small: eval_every 10
    assert evals[STEPS] < evals[10]  # it learns, measured on the held-out split
    assert result["objective"] == pytest.approx(evals[STEPS])  # trainer.objective: eval/loss

    records = hook_log(baseline)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert records[-1] == {"end": "done", "step": STEPS}
    losses = scalars(baseline / "tb", "train/loss")
    assert all(r["loss"] == pytest.approx(losses[r["step"]]) for r in records if "loss" in r)

    # conf/train.yaml's mesh (data x model), where task.logical_axis_rules split the model.
    out = (baseline / "train.log").read_text()
    assert "mesh=cpu4x2" in out and "Training regression" in out


def test_example_sweep_2x2(venv_python, example):
    proc = train(
        venv_python, example, "-m", "--config-name", "sweep", "hydra.sweep.dir=sweep", ONE_PATH
    )
    sweep = example / "sweep"
    results = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    assert len(results) == 4 and all(r["status"] == "completed" for r in results), results
    table = (sweep / "sweep_summary.md").read_text()
    assert "4 jobs: 4 completed" in proc.stdout + table
    for overrides in (
        "experiment=small optimizer.learning_rate=0.003",
        "experiment=small optimizer.learning_rate=0.01",
        "experiment=wide optimizer.learning_rate=0.003",
        "experiment=wide optimizer.learning_rate=0.01",
    ):
        assert overrides in table, table
    assert all(r["objective"] > 0 for r in results)  # each job's final eval/loss


def test_example_resumes_after_sigterm_bitwise(venv_python, example, baseline):
    run = example / "runs" / "stopped"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    log = example / "stopped.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(venv_python), "train.py", *RUN, f"hydra.run.dir={run}"],
            cwd=example,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # The custom hook's file shows training has begun: stop the run mid-way.
        wait_until(lambda: hook_log(run) or proc.poll() is not None, 240, "a first step")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == EXIT_PREEMPTED, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = max(complete_steps(run / "checkpoints"))
    assert 1 <= stopped < STEPS, stopped
    assert hook_log(run)[-1] == {"end": "stopped", "step": stopped}

    resumed = train(venv_python, example, *RUN, f"hydra.run.dir={run}")
    assert f"Restored step {stopped} from" in resumed.stdout + resumed.stderr
    assert_bitwise_equal(
        load_state(run / "checkpoints" / str(STEPS)),
        load_state(baseline / "checkpoints" / str(STEPS)),
    )
    assert scalars(run / "tb", "train/loss") == scalars(baseline / "tb", "train/loss")
    assert scalars(run / "tb", "eval/loss")[STEPS] == scalars(baseline / "tb", "eval/loss")[STEPS]
    records = hook_log(run)  # the hook appends: the stop, then the resumed steps
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert [r for r in records if "end" in r] == [
        {"end": "stopped", "step": stopped},
        {"end": "done", "step": STEPS},
    ]


def venv_run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python ARGS` of the venv in `cwd`, without this environment's PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_its_own_runs_load_and_evaluate_without_flags(venv_python, example, baseline):
    """The installed package's entry point (pyproject.toml) trusts my_experiments.: its run
    dir loads and evaluates as it is, given relative to another working directory."""
    elsewhere = example.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    relative = os.path.relpath(baseline, elsewhere)  # ../<example>/runs/baseline
    evaluated = venv_run(venv_python, elsewhere, "-m", "trainers.evaluate", relative)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"step {STEPS}: eval/loss=" in evaluated.stdout
    record = json.loads((baseline / f"eval_step{STEPS}.json").read_text())
    final = scalars(baseline / "tb", "eval/loss")[STEPS]
    assert record["metrics"]["eval/loss"] == pytest.approx(final, rel=1e-5)
    assert "changed config" not in evaluated.stderr

    script = (
        "import trainers\n"
        f"run = trainers.load({relative!r})\n"
        "print('loaded', run.step, run.config.task.model._target_)\n"
    )
    loaded = venv_run(venv_python, elsewhere, "-c", script)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert f"loaded {STEPS} my_experiments.models.MLP" in loaded.stdout


def test_a_copied_run_dir_naming_other_code_is_still_refused(venv_python, example, baseline):
    """The entry point trusts my_experiments. only: a copied run dir that adds os. to its
    allowlist and names os.system as its task is refused before anything of it runs."""
    copy = example.parent / "copied_run"
    shutil.copytree(baseline, copy, ignore=shutil.ignore_patterns("eval_step*.json"))
    pwned = example.parent / "pwned"
    config = yaml.safe_load((copy / ".hydra" / "config.yaml").read_text())
    assert config["allowed_targets"] == ["my_experiments."]  # what the run recorded
    config["allowed_targets"].append("os.")
    config["task"] = {"_target_": "os.system", "command": f"touch {pwned}"}
    (copy / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    load = f"import trainers; trainers.load({str(copy)!r})"
    for args in (["-m", "trainers.evaluate", str(copy)], ["-c", load]):
        result = venv_run(venv_python, example.parent, *args)
        assert result.returncode != 0, result.stdout
        assert "allows _target_s under 'os.'" in result.stderr, result.stderr[-2000:]
        assert '[project.entry-points."xshard.allowed_targets"] os = "os"' in result.stderr
    assert not pwned.exists() and not list(copy.glob("eval_step*.json"))
