"""Copied config files against the real CLI (subprocesses; all marked slow): every file below
tries to run a command through a key Hydra acts on before the run starts, or to forge the
command line. Each run exits 2 with one line naming the file, and the command never runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import refused, run_train

COMMON = ["task=mlp", "mesh=cpu8", "trainer.batch_size=16", "trainer.steps=2", "checkpoint=none"]


def touch(canary: Path) -> str:
    return f"touch {canary}"


# name -> (file under the copied config dir, its text with {cmd} for the command, overrides,
#          the key the error names)
ATTACKS = {
    "forged command line (the audit's file)": (
        "task/inject.yaml",
        """\
        # @package _global_
        task: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        allowed_targets: [subprocess.]
        hydra: {{overrides: {{task: ["+allowed_targets=[subprocess.]"]}}}}
        """,
        ["task=inject"],
        "hydra.overrides.task",
    ),
    "widened allowlist": (
        "task/widen.yaml",
        """\
        # @package _global_
        task: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        allowed_targets: [subprocess.]
        """,
        ["task=widen"],
        "allowed_targets to 'subprocess.'",
    ),
    "forged command line alone": (
        "task/forge.yaml",
        """\
        # @package _global_
        task: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        hydra: {{overrides: {{task: ["+allowed_targets=[subprocess.]"]}}}}
        """,
        ["task=forge"],
        "hydra.overrides.task",
    ),
    "callback": (
        "experiment/cb.yaml",
        """\
        # @package _global_
        hydra: {{callbacks: {{x: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}}}}}
        """,
        ["experiment=cb"],
        "hydra.callbacks.x._target_",
    ),
    "logging factory": (
        "experiment/log.yaml",
        """\
        # @package _global_
        hydra:
          job_logging:
            handlers:
              file: {{"()": subprocess.getoutput, cmd: "{cmd}"}}
        """,
        ["experiment=log"],
        "hydra.job_logging.handlers.file",
    ),
    "hydra logging option of a copied dir": (
        "hydra/hydra_logging/evil.yaml",
        """\
        version: 1
        handlers: {{h: {{"()": subprocess.getoutput, cmd: "{cmd}"}}}}
        root: {{handlers: [h]}}
        """,
        ["hydra/hydra_logging=evil"],
        "hydra.hydra_logging.",
    ),
    "package header": (
        "extra/cb.yaml",
        """\
        # @package hydra.callbacks
        x: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        """,
        ["+extra=cb"],
        "hydra.callbacks.x._target_",
    ),
    "resolver-made node": (
        "experiment/resolver.yaml",
        """\
        # @package _global_
        hydra:
          callbacks: "${{oc.create:{{x: {{_target_: subprocess.getoutput, cmd: '{cmd}'}}}}}}"
        """,
        ["experiment=resolver"],
        "hydra.callbacks",
    ),
    "environment": (
        "experiment/env.yaml",
        """\
        # @package _global_
        hydra: {{job: {{env_set: {{PYTHONSTARTUP: "{cmd}"}}}}}}
        """,
        ["experiment=env"],
        "hydra.job.env_set.PYTHONSTARTUP",
    ),
    "multirun hydra overrides": (
        "experiment/sweep.yaml",
        """\
        # @package _global_
        hydra:
          overrides:
            hydra:
              - "+hydra.callbacks.x._target_=subprocess.getoutput"
              - "+hydra.callbacks.x.cmd='{cmd}'"
        """,
        ["-m", "experiment=sweep"],
        "hydra.overrides.hydra",
    ),
    "a job of a sweep": (
        "task/inject.yaml",
        """\
        # @package _global_
        task: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        hydra: {{callbacks: {{x: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}}}}}
        """,
        ["-m", "task=mlp,inject"],
        "hydra.callbacks.x._target_",
    ),
    "optuna sampler": (
        "experiment/optuna.yaml",
        """\
        # @package _global_
        defaults:
          - override /hydra/sweeper: optuna
        hydra:
          sweeper:
            n_trials: 1
            sampler: {{_target_: subprocess.getoutput, cmd: "{cmd}"}}
        """,
        ["-m", "experiment=optuna"],
        "defaults: /hydra/sweeper",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", ATTACKS)
def test_a_copied_config_file_runs_nothing(tmp_path, name):
    path, text, overrides, key = ATTACKS[name]
    canary = tmp_path / "canary"
    conf = tmp_path / "copied"
    (conf / path).parent.mkdir(parents=True)
    (conf / path).write_text(textwrap.dedent(text.format(cmd=touch(canary))))
    flags = [o for o in overrides if o.startswith("-")]
    result = run_train(
        *flags,
        f"hydra.searchpath=[file://{conf}]",
        *COMMON,
        *[o for o in overrides if not o.startswith("-")],
        f"hydra.run.dir={tmp_path / 'run'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
        check=False,
    )
    refused(result, f"config file {conf / path} sets {key}")
    assert "Traceback" not in result.stderr
    assert not canary.exists()
    assert not (tmp_path / "run").exists()


def run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def copied_conf(tmp_path) -> tuple[Path, Path]:
    """A copied dir with the audit's file; returns it and the canary its command would make."""
    canary = tmp_path / "canary"
    path, text, _, _ = ATTACKS["forged command line (the audit's file)"]
    conf = tmp_path / "copied"
    (conf / path).parent.mkdir(parents=True)
    (conf / path).write_text(textwrap.dedent(text.format(cmd=touch(canary))))
    return conf, canary


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "flags"),
    [("trainers.doctor", []), ("trainers.train", ["--cfg", "job"])],
    ids=["doctor", "cfg"],
)
def test_the_doctor_and_cfg_refuse_the_same_file(tmp_path, copied_conf, module, flags):
    conf, canary = copied_conf
    result = run_module(module, *flags, f"--config-dir={conf}", "task=inject", cwd=tmp_path)
    refused(result, f"config file {conf / 'task' / 'inject.yaml'} sets hydra.overrides.task")
    assert not canary.exists()


@pytest.mark.slow
def test_an_experiment_repo_app_is_guarded_too(tmp_path, copied_conf):
    """`trainers.main`, the decorator docs/config.md gives experiment repos, runs the guard."""
    conf, canary = copied_conf
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent("""\
        import trainers

        @trainers.main(config_path="pkg://xshard.conf", config_name="xshard_train")
        def main(cfg):
            return trainers.run(cfg)

        if __name__ == "__main__":
            main()
        """)
    )
    result = subprocess.run(
        [sys.executable, str(app), f"hydra.searchpath=[file://{conf}]", "task=inject"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    refused(result, f"config file {conf / 'task' / 'inject.yaml'} sets hydra.overrides.task")
    assert not canary.exists()
