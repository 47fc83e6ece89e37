"""The house rules that a reader would otherwise have to trust: no import cycles between
modules, each wing says what it may import, the layering contract holds (import-linter, the
same check `make lint` runs), and the library never imports the trainer."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests import REPO

WINGS = ["app", "checkpoint", "cluster", "config", "core", "data", "hooks", "rundir", "tasks"]


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other (size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_two_modules_import_each_other():
    graph = grimp.build_graph("trainers", "xshard")
    modules = set(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & modules for m in modules}
    # A package's __init__ re-exporting its modules is not a cycle of concerns.
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in edges.items()}
    assert strongly_connected(edges) == []


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_says_what_lives_there_and_what_it_may_import(wing):
    doc = importlib.import_module(f"trainers.{wing}").__doc__ or ""
    assert len(doc.split()) > 15, f"trainers.{wing} has no docstring worth the name"
    if wing not in ("data", "tasks"):
        assert "May import" in doc or "may import" in doc, f"trainers.{wing}: {doc!r}"


def test_the_layering_contract_holds():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_tests_mirror_the_wings():
    """Test files live beside the code they test: `tests/trainers/<wing>/` for each wing,
    `tests/xshard/` for the library, `tests/config/` for the config tree; only project-wide
    tests (layering, packaging, examples, benchmarks) stay at the top."""
    tests = REPO / "tests"
    folders = {
        p.name for p in (tests / "trainers").iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    wings_with_tests = set(WINGS) - {"config"}  # trainers/config is tested from tests/config/
    assert folders <= set(WINGS), f"test folders without a wing: {sorted(folders - set(WINGS))}"
    assert wings_with_tests <= folders, f"wings without tests: {sorted(wings_with_tests - folders)}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    project_wide = {
        "test_architecture.py",
        "test_bench_axis_traffic.py",
        "test_bench_plots.py",
        "test_benchmarks_smoke.py",
        "test_device_check.py",
        "test_example_repo.py",
        "test_examples.py",
        "test_imports.py",
        "test_packaging.py",
        "test_reductions_bench_smoke.py",
        "test_zero_bench_smoke.py",
    }
    assert set(top) <= project_wide, f"put these in the folder of what they test: {top}"
