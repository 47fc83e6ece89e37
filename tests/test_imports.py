"""The package's import structure: light entry points, no module shadowed by a function."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import xshard


def _imported_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport sys\n"
        "print(' '.join(sorted(m for m in ('jax', 'jaxlib', 'optax') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    return out.stdout.split()


def test_import_xshard_and_the_config_layers_do_not_import_jax():
    assert _imported_after("import xshard") == []
    assert _imported_after("import xshard.config.schemas") == []
    imports = "import trainers.config.trainer_schemas; trainers.config.TrainerOptions"
    assert _imported_after(imports) == []


def test_public_names_resolve_lazily_to_their_definitions():
    for name in xshard.__all__:
        value = getattr(xshard, name)
        assert getattr(value, "__name__", name) == name
        assert value.__module__.startswith("xshard.")
    assert inspect.isfunction(xshard.cross_shard)
    assert set(xshard.__all__) <= set(dir(xshard))


def test_modules_are_not_shadowed_by_functions():
    for name in ("optim", "reduce", "guard", "mesh", "stats", "config"):
        module = importlib.import_module(f"xshard.{name}")
        assert inspect.ismodule(module) and getattr(xshard, name) is module
    # Importing every module leaves the public function in place.
    assert inspect.isfunction(xshard.cross_shard)
