"""The package's import structure: light entry points, no module shadowed by a function."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import xshard


def _imported_after(code: str, among: tuple[str, ...] = ("jax", "jaxlib", "optax")) -> list[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(m for m in {among!r} if m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    return out.stdout.split()


def test_import_xshard_and_the_config_layers_do_not_import_jax():
    assert _imported_after("import xshard") == []
    assert _imported_after("import xshard.config.schemas") == []
    imports = "import trainers.config.trainer_schemas; trainers.config.TrainerOptions"
    assert _imported_after(imports) == []


@pytest.mark.slow  # three fresh interpreters importing JAX and PyTorch: ~8 s
def test_the_tensorboard_logger_imports_neither_torch_nor_gcs_but_leaves_them_importable():
    # tensorboardX imports both when installed (~1.3 CPU-s of every run's start-up with the
    # elastic extra's torch); trainers.hooks.tbx hides them from it only.
    pytest.importorskip("torch")
    hidden = ("torch", "google.cloud.storage")
    assert _imported_after("import trainers.hooks.tensorboard", hidden) == []
    shown = "import trainers.hooks.tensorboard, torch, tensorboardX.writer"
    assert _imported_after(shown, hidden) == ["torch"]
    # torch imported first stays as it was, and tensorboardX sees it as it always did.
    first = "import torch, trainers.hooks.tensorboard, tensorboardX.writer as w; assert w.torch"
    assert "torch" in _imported_after(first, hidden)


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
