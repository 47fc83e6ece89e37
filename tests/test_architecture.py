"""The house rules that a reader would otherwise have to trust: no import cycles between
modules, each wing says what it may import, the layering contract holds (import-linter, the
same check `make lint` runs), and the library never imports the trainer."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
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
    assert "May import" in doc, f"trainers.{wing}: {doc!r}"


def may_import(wing: str) -> set[str]:
    """The modules trainers.<wing>'s docstring names after "May import:" (`xshard` standing
    for each of its parts), up to the end of that sentence."""
    doc = importlib.import_module(f"trainers.{wing}").__doc__ or ""
    sentence = re.search(r"May import:(.*?)(?:\.\s|\.$|;)", doc, re.S)
    assert sentence, f"trainers.{wing}: no 'May import: ...' sentence"
    names = set(re.findall(r"`([\w.]+)`", sentence.group(1)))
    if "xshard" in names:
        names = (names - {"xshard"}) | set(XSHARD_PARTS)
    return names


#: The parts of xshard a wing's docstring may name (`xshard` stands for all of them).
XSHARD_PARTS = sorted(
    f"xshard.{p.stem if p.suffix else p.name}"
    for p in (REPO / "xshard").iterdir()
    if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
)


@pytest.mark.parametrize("wing", [w for w in WINGS if w != "app"])
def test_what_a_wing_may_import_is_an_import_contract(wing):
    """The docs cannot drift from the code: each wing's "May import" sentence and its
    `forbidden` contract in pyproject.toml (run by lint-imports) split the other wings and
    xshard's parts between them, with nothing left over."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [
        c
        for c in contracts["contracts"]
        if c["type"] == "forbidden"
        and c["source_modules"] == [f"trainers.{wing}"]
        and c.get("allow_indirect_imports")
    ]
    others = {f"trainers.{w}" for w in WINGS if w != wing} | {"trainers.exits", *XSHARD_PARTS}
    allowed, forbidden = may_import(wing), set(contract["forbidden_modules"])
    assert not allowed & forbidden, sorted(allowed & forbidden)
    assert allowed | forbidden == others, sorted(others ^ (allowed | forbidden))


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
        "test_dcn_bench_smoke.py",
        "test_device_check.py",
        "test_example_repo.py",
        "test_examples.py",
        "test_imports.py",
        "test_optimizer_quality_bench_smoke.py",
        "test_packaging.py",
        "test_reductions_bench_smoke.py",
        "test_zero_bench_smoke.py",
    }
    assert set(top) <= project_wide, f"put these in the folder of what they test: {top}"


#: The longest function body the house allows (lines of code: no docstring, blank lines or
#: comments); docs/architecture.md, "Rules of the house".
MAX_FUNCTION_LINES = 60


def code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code of a function: its lines less its docstring, blank lines and comments."""
    first = node.body[0]
    doc = (
        range(first.lineno, (first.end_lineno or first.lineno) + 1)
        if ast.get_docstring(node) is not None
        else range(0)
    )
    body = range(node.lineno, (node.end_lineno or node.lineno) + 1)
    return sum(1 for i in body if i not in doc and lines[i - 1].strip()[:1] not in ("", "#"))


def test_no_function_is_longer_than_the_house_allows():
    long = []
    for package in ("xshard", "trainers"):
        for path in sorted((REPO / package).rglob("*.py")):
            source = path.read_text()
            lines = source.splitlines()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = code_lines(lines, node)
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n})")
    assert not long, f"split these (at most {MAX_FUNCTION_LINES} lines of code): {long}"


def test_no_two_modules_share_a_file_name():
    """One file name, one module (docs/architecture.md, "Rules of the house"): in `xshard/` and
    `trainers/`, a file name appears once, but for `__init__.py` and the convention that
    `trainers/config/<x>.py` holds the config node of the feature in `trainers/<wing>/<x>.py`."""
    by_name: dict[str, list[str]] = {}
    for package in ("xshard", "trainers"):
        for path in sorted((REPO / package).rglob("*.py")):
            by_name.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    shared = {
        name: paths
        for name, paths in by_name.items()
        if len(paths) > 1 and name != "__init__.py" and not is_config_node_pair(name, paths)
    }
    assert not shared, f"rename one of each so the name says what it holds: {shared}"


def is_config_node_pair(name: str, paths: list[str]) -> bool:
    """Whether `paths` are a feature's config node and the feature: ``trainers/config/<name>``
    and one other module of a trainers wing."""
    node = f"trainers/config/{name}"
    others = [p for p in paths if p != node]
    return len(paths) == 2 and node in paths and others[0].startswith("trainers/")
