"""The ``_target_`` allowlist holds: no path reaches a callable defined outside it.

`resolve_target` checks the dotted name, then walks attributes. These tests try every path
that walks through the allowed packages (attributes, their attributes, dunders), the known
exploits, and the shapes a user package can take; and they check who may widen the list.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys
import textwrap
import warnings
from types import SimpleNamespace

import pytest

from trainers.app.allowlist import (
    ALLOWED_TARGETS_ENV,
    ENTRY_POINT_GROUP,
    argv_overrides,
    command_line_entries,
    environment_entries,
    export_command_line_entries,
    installed_entries,
    primary_config_entries,
)
from xshard.config.targets import (
    DEFAULT_ALLOWED_TARGETS,
    allowed_prefixes,
    is_allowed,
    resolve_target,
)
from xshard.errors import ConfigError

#: The defaults, and the whole packages (what a user who lists them in allowed_targets gets).
ALLOWLISTS = {
    "default": DEFAULT_ALLOWED_TARGETS,
    "whole_packages": ("optax.", "xshard.", "trainers."),
}

# --------------------------------------------------------------------------------------------
# Every path through the allowed packages
# --------------------------------------------------------------------------------------------


@functools.cache
def _all_modules() -> tuple:
    """Every importable module under optax, xshard and trainers (optax's own tests left out)."""
    found = []
    for top in ("optax", "xshard", "trainers"):
        package = importlib.import_module(top)
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda _: None):
            if info.name.endswith("_test"):  # optax's test files; private names anyway
                continue
            try:
                found.append(importlib.import_module(info.name))
            except ImportError:  # optional dependencies of a module; nothing to resolve there
                continue
    return tuple(found)


def _paths(module) -> list[str]:
    """``m.attr`` and ``m.attr.sub`` for every (public or private) name, plus dunder escapes."""
    name = module.__name__
    paths = [
        f"{name}.{escape}"
        for escape in (
            "__builtins__.eval",
            "__builtins__.exec",
            "__builtins__.__import__",
            "__loader__.load_module",
            "__spec__.loader",
            "__dict__.get",
            "__class__.__subclasses__",
        )
    ]
    for attr in dir(module):
        paths.append(f"{name}.{attr}")
        value = getattr(module, attr, None)
        paths += [f"{name}.{attr}.{sub}" for sub in dir(value)]
        if inspect.isfunction(value):
            paths += [f"{name}.{attr}.__globals__.os", f"{name}.{attr}.__globals__.__builtins__"]
    return paths


@pytest.mark.parametrize("allowed", ALLOWLISTS.values(), ids=ALLOWLISTS.keys())
def test_no_path_through_the_allowed_packages_reaches_a_foreign_callable(allowed):
    modules = _all_modules()
    loaded = set(sys.modules)
    resolved, refused = {}, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optax's deprecated aliases warn on access
        for module in modules:
            for path in _paths(module):
                try:
                    resolved[path] = resolve_target(path, allowed)
                except ConfigError:
                    refused += 1
    for path, obj in resolved.items():
        target = obj
        while isinstance(target, functools.partial):
            target = target.func
        assert inspect.isclass(target) or inspect.isfunction(target), (path, obj)
        home = f"{target.__module__}.{target.__qualname__}"
        assert is_allowed(home, allowed), (path, home)
    assert set(sys.modules) == loaded, "resolving imported modules"
    # Not vacuous: the configured targets resolve and most paths are refused.
    for path in ("optax.adamw", "optax.nadamw", "xshard.schedules.warmup_cosine"):
        assert path in resolved
    assert "trainers.tasks.mlp.MLPTask" in resolved
    assert refused > 10 * len(resolved)


# --------------------------------------------------------------------------------------------
# Known exploits and what a target may be
# --------------------------------------------------------------------------------------------

# path: a fragment of the message, refused under both allowlists
EXPLOITS = {
    "trainers.app.preflight.os.system": "is the module 'os'",
    "trainers.checkpoint.resume.shutil.rmtree": "is the module 'shutil'",
    "xshard.config.targets.importlib.import_module": "is the module 'importlib'",
    "trainers.tasks.mlp.np.save": "is the module 'numpy'",
    "trainers.train.__builtins__": "'__builtins__' is a private name",
    "trainers.tasks.mlp.MLPTask.__init__.__globals__": "'__init__' is a private name",
    "optax.adamw.__globals__": "'__globals__' is a private name",
    "optax._src.alias.adamw": "'_src' is a private name",
    "optax": "it is a module",
    "optax.contrib": "it is a module",
    "optax.bias_correction": "it is a PjitFunction",
    "optax.Params": "a Python class or function",
    "optax.adamw.x": "'optax.adamw' is a function, not a module",
    "trainers.tasks.mlp.MLPTask.batches": "'trainers.tasks.mlp.MLPTask' is a class, not a module",
    "trainers.tasks.sharding.Mesh": "'jax._src.mesh.Mesh', defined outside",
}


@pytest.mark.parametrize("allowed", ALLOWLISTS.values(), ids=ALLOWLISTS.keys())
@pytest.mark.parametrize("path, message", EXPLOITS.items(), ids=EXPLOITS.keys())
def test_known_exploits_are_refused(path, message, allowed):
    with pytest.raises(ConfigError) as e:
        resolve_target(path, allowed, key="task._target_")
    assert str(e.value).startswith(f"task._target_={path!r} is not an allowed target")
    if is_allowed(path, allowed):  # else: refused by name, before anything is imported
        assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_builtins_and_foreign_modules_are_refused_by_name():
    for path in ("builtins.eval", "os.system", "shutil.rmtree", "subprocess.run"):
        with pytest.raises(ConfigError, match="is not an allowed target. Allowed prefixes"):
            resolve_target(path, key="task._target_")


def test_reexport_of_a_project_function_outside_the_defaults_is_refused():
    # trainers.tasks.sharding imports path_str from xshard.stats.tree: allowed by name, not by home.
    with pytest.raises(ConfigError, match="'xshard.stats.tree.path_str', defined outside"):
        resolve_target("trainers.tasks.sharding.path_str")
    assert resolve_target("trainers.tasks.sharding.path_str", ALLOWLISTS["whole_packages"])


@pytest.mark.parametrize("entry", ["os system", "mypkg..x", "", ".", "mypkg.-x"])
def test_allowed_targets_entries_must_be_dotted_names(entry):
    with pytest.raises(ConfigError, match="allowed_targets=.*expected a list of module prefixes"):
        allowed_prefixes([entry])


# --------------------------------------------------------------------------------------------
# A user's package, listed in allowed_targets
# --------------------------------------------------------------------------------------------

USER_PACKAGE = """
import functools
import os
from json import dumps

import xs_foreign
from xs_user_pkg._impl import impl_fn


def my_fn(x=1):
    return x


class MyTask:
    pass


class Holder:
    @staticmethod
    def make():
        return 1

    @classmethod
    def build(cls):
        return cls()


def _factory():
    def inner():
        return 0
    return inner


my_partial = functools.partial(my_fn, x=2)
cwd_partial = functools.partial(os.getcwd)
lam = lambda: 0  # noqa: E731
made = _factory()


def forged():
    return 0


forged.__qualname__ = "my_fn"  # claims a name that holds another object
"""


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """``xs_user_pkg`` (with a private submodule) and ``xs_foreign``, whose submodule
    ``boom`` touches a marker file when imported."""
    pkg = tmp_path / "xs_user_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(USER_PACKAGE))
    (pkg / "_impl.py").write_text("def impl_fn():\n    return 'impl'\n")
    (tmp_path / "xs_foreign").mkdir()
    (tmp_path / "xs_foreign" / "__init__.py").write_text("")
    marker = tmp_path / "boom-imported"
    (tmp_path / "xs_foreign" / "boom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\ndef f():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield SimpleNamespace(marker=marker)
    for name in [m for m in sys.modules if m.split(".")[0] in ("xs_user_pkg", "xs_foreign")]:
        del sys.modules[name]


USER_OK = [
    "xs_user_pkg.my_fn",
    "xs_user_pkg.MyTask",
    "xs_user_pkg.my_partial",
    "xs_user_pkg.impl_fn",
]
USER_REFUSED = {
    "xs_user_pkg.dumps": "'json.dumps', defined outside",
    "xs_user_pkg.os.system": "is the module 'os'",
    "xs_user_pkg.xs_foreign.boom.f": "is the module 'xs_foreign'",
    "xs_user_pkg.cwd_partial": "it is a builtin_function_or_method",
    "xs_user_pkg.lam": "'xs_user_pkg.<lambda>', not defined at the top level",
    "xs_user_pkg.made": "'xs_user_pkg._factory.<locals>.inner', not defined at the top level",
    "xs_user_pkg.Holder.make": "'xs_user_pkg.Holder' is a class, not a module",
    "xs_user_pkg.Holder.build": "'xs_user_pkg.Holder' is a class, not a module",
    "xs_user_pkg.forged": "claims to be 'xs_user_pkg.my_fn'",
    "xs_user_pkg._factory": "'_factory' is a private name",
}


def test_user_package_classes_and_functions_resolve_once_listed(user_package):
    allowed = allowed_prefixes(["xs_user_pkg."])
    for path in USER_OK:
        with pytest.raises(ConfigError, match="is not an allowed target. Allowed prefixes"):
            resolve_target(path)
        assert callable(resolve_target(path, allowed))
    assert resolve_target("xs_user_pkg.my_partial", allowed)() == 2
    assert resolve_target("xs_user_pkg.impl_fn", allowed)() == "impl"  # a re-export in the package


@pytest.mark.parametrize("path, message", USER_REFUSED.items(), ids=USER_REFUSED.keys())
def test_user_package_refuses_what_is_not_its_own_top_level_class_or_function(
    user_package, path, message
):
    with pytest.raises(ConfigError) as e:
        resolve_target(path, allowed_prefixes(["xs_user_pkg."]), key="optimizer._target_")
    assert str(e.value).startswith(f"optimizer._target_={path!r} is not an allowed target: ")
    assert message in str(e.value)
    assert not user_package.marker.exists()  # xs_foreign.boom was never imported


def test_exact_path_entry_allows_that_target_only(user_package):
    allowed = allowed_prefixes(["xs_user_pkg.my_fn"])
    assert resolve_target("xs_user_pkg.my_fn", allowed)() == 1
    with pytest.raises(ConfigError, match="'xs_user_pkg.MyTask' is not an allowed target"):
        resolve_target("xs_user_pkg.MyTask", allowed)


# --------------------------------------------------------------------------------------------
# Who may widen: the entries that count (the CLI runs are in test_allowlist_cli.py)
# --------------------------------------------------------------------------------------------


def test_command_line_entries_are_parsed_by_hydra():
    overrides = [
        "task=mlp",
        "+allowed_targets=[a., 'b.c']",
        "allowed_targets.2=d.",
        "++allowed_targets=[e.]",
        "+experiment=evil",
        "optimizer._target_=os.system",
    ]
    assert command_line_entries(overrides) == {"a.", "b.c", "d.", "e."}
    assert command_line_entries(["~allowed_targets", "task=mlp"]) == set()


def test_primary_config_entries_come_from_that_file_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XS_ALLOWED_PKG", "envpkg.")
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "evil.yaml").write_text("# @package _global_\nelsewhere: os.\n")
    (tmp_path / "mine.yaml").write_text(
        textwrap.dedent("""
        defaults:
          - xshard_train
          - experiment: evil
          - _self_
        mine: local.
        allowed_targets: [mypkg., "${oc.env:XS_ALLOWED_PKG}", "${mine}", "${elsewhere}"]
        """)
    )
    sources = [
        SimpleNamespace(provider="command-line", schema="file", path=str(tmp_path)),
        SimpleNamespace(provider="main", schema="pkg", path="xshard.conf"),
        SimpleNamespace(provider="schema", schema="structured", path=""),
    ]
    assert primary_config_entries("mine", sources) == {"mypkg.", "envpkg.", "local."}
    assert primary_config_entries("xshard_train", sources) == set()


def test_command_line_entries_come_from_the_process_arguments():
    argv = ["-m", "--config-dir", "conf", "task=mlp", "+allowed_targets=[a.]", "--cfg", "job"]
    assert argv_overrides(argv) == ["task=mlp", "+allowed_targets=[a.]"]
    assert command_line_entries(argv_overrides(argv)) == {"a."}
    # a launcher's worker process runs with arguments that are not Hydra's
    assert command_line_entries(argv_overrides(["/tmp/submitit/job_0", "--folder"])) == set()


def test_environment_and_installed_packages_widen_the_allowlist(tmp_path, monkeypatch):
    monkeypatch.setenv(ALLOWED_TARGETS_ENV, " envpkg., other.mod.fn ,, ")
    assert environment_entries() == {"envpkg.", "other.mod.fn"}
    dist = tmp_path / "xs_models-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xs-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nxs_models = xs_models\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "xs_models." in installed_entries()


def test_the_command_line_entries_reach_a_launchers_processes(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "task=mlp", "+allowed_targets=[typed.]"])
    monkeypatch.setenv(ALLOWED_TARGETS_ENV, "envpkg.")
    export_command_line_entries()
    assert environment_entries() == {"envpkg.", "typed."}
