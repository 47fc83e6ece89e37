"""The benchmark still runs: ``python -m benchmarks.run --smoke`` writes every section.

Checks structure and sanity only (every number finite, times and sizes positive, no step
recompiling after its first call); never how fast anything is.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.workloads import CLI_OPTIMIZERS, WORKLOADS, make_workload
from tests import REPO

pytestmark = pytest.mark.long

ROOT = REPO
SECTIONS = (
    "overhead",
    "stats",
    "collectives",
    "memory",
    "compile",
    "host",
    "scaling",
    "optimizers",
)
#: The workload the smoke run times: the sections' code is the same for every workload, and
#: tiny_gpt's programs cost the run ~3 minutes of compiling on 2 cores; every workload's config
#: and batches are built below (`test_every_workload_composes_and_draws_its_batches`).
TASKS = ("mlp",)


def _numbers(tree: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf of `tree` (bools excluded), with its path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _numbers(v, f"{path}/{i}")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


def _positive_times(summary: dict[str, Any], where: str) -> None:
    for key in ("median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms"):
        assert summary[key] > 0, f"{where}: {key}={summary[key]}"
    assert summary["blocks"] >= 1, where


def _positive_ratio(r: dict[str, float], where: str) -> None:
    for key in ("ratio_of_medians", "paired_median", "paired_q1", "paired_q3"):
        assert r[key] > 0, f"{where}: {key}={r[key]}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--tasks",
            ",".join(TASKS),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert out.with_suffix(".md").read_text().startswith("# xshard benchmarks")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_composes_and_draws_its_batches(name):
    work = make_workload(name, smoke=True, num_batches=2)
    assert work.global_batch_size == work.cfg.trainer.batch_size > 0
    assert len(work.host_batches) == 2 and all(b for b in work.host_batches)
    assert work.model_config()["task"]


@pytest.mark.slow
def test_every_section_ran_and_every_number_is_finite(results):
    meta = results["meta"]
    assert meta["mode"] == "smoke"
    assert meta["failed_sections"] == [] and meta["nonfinite_paths"] == []
    assert meta["device_count"] == 8 and meta["platform"] == "cpu" and meta["device_kind"]
    assert meta["jax_version"] and meta["cpu_count"] >= 1
    for name in SECTIONS:
        assert name in results["sections"], name
        assert "error" not in results["sections"][name], results["sections"][name]
    for path, value in _numbers(results):
        assert math.isfinite(value), path


@pytest.mark.slow
def test_step_times_and_ratios_are_positive_and_nothing_recompiles(results):
    s = results["sections"]
    for task in TASKS:
        over = s["overhead"][task]
        for name, summary in over["variants"].items():
            _positive_times(summary, f"overhead/{task}/{name}")
            assert summary["compiles_while_timed"] == 0, (task, name)
            assert over["program"][name]["kernels"] > 0
        for name, r in over["ratio_to_fastest_handwritten"].items():
            _positive_ratio(r, f"overhead/{task}/{name}")
        stats = s["stats"][task]
        _positive_ratio(stats["every_step"]["full_vs_none"], f"stats/{task}")
        for name, summary in stats["diagnostics"]["variants"].items():
            _positive_times(summary, f"stats/{task}/{name}")
        for name, v in s["compile"][task]["variants"].items():
            # stats10 shares xshard_trainer's executable: its first call compiles nothing.
            least = 0 if name.endswith("_stats10") else 1
            assert v["first_call"]["wall_s"] > 0 and v["first_call"]["compiles"] >= least, name
            assert v["later_compiles"] == 0, (task, name)
        shape_change = s["compile"][task]["shape_change"]
        assert shape_change["raised"] and shape_change["compiles"] == 0
    for name, summary in s["host"]["variants"].items():
        _positive_times(summary, f"host/{name}")
    optimizers = s["optimizers"]["mlp"]  # the section's smoke task
    assert list(optimizers["variants"]) == list(CLI_OPTIMIZERS)
    assert list(optimizers["vs_adamw"]) == list(CLI_OPTIMIZERS)[1:]
    for name, summary in optimizers["variants"].items():
        _positive_times(summary, f"optimizers/{name}")
        assert summary["compiles_while_timed"] == 0, name
        assert optimizers["overrides"][name] == list(CLI_OPTIMIZERS[name])
    for name, r in optimizers["vs_adamw"].items():
        _positive_ratio(r, f"optimizers/{name}")
    for task in TASKS:
        rows = s["scaling"][task]
        assert [r["devices"] for r in rows] == s["scaling"]["device_counts"]
        for r in rows:
            _positive_times(r["xshard_trainer"], f"scaling/{task}/{r['devices']}")
            _positive_times(r["jit_gspmd"], f"scaling/{task}/{r['devices']}")


@pytest.mark.slow
def test_collectives_and_memory_are_read_from_the_compiled_steps(results):
    s = results["sections"]
    for task in TASKS:
        for name, c in s["collectives"][task].items():
            totals = c["totals"]
            assert totals["collective_ops"] >= 1, (task, name)  # 8 shards: gradients are reduced
            assert totals["gradient_operands"] >= 1 and totals["gradient_bytes"] > 0, (task, name)
        for name, m in s["memory"][task].items():
            assert m["params_bytes_per_device"] > 0 and m["opt_state_bytes_per_device"] > 0
            assert m["compiled"]["argument_size_in_bytes"] > 0, (task, name)
