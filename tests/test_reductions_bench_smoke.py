"""The per-axis reductions benchmark still runs: ``python -m benchmarks.reductions --smoke``.

Checks structure and sanity (what the compiled programs hold, finite losses, positive
times), never how fast anything is.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests import REPO

pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("reductions") / "reductions.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.reductions", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert out.with_suffix(".md").read_text().startswith("# Per-axis reductions")
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bytes_per_axis_come_from_the_compiled_programs(results):
    b = results["bytes"]
    assert results["meta"]["mode"] == "smoke" and results["meta"]["device_count"] == 8
    mean, local, int8 = b["mean"], b["local_sgd H=8"], b["diloco_int8 H=8"]
    # The synchronous step reduces over both axes; a periodic run's inner step over data only.
    assert mean["programs"]["inner"]["slice"]["ops"] and "sync" not in mean["programs"]
    for v in (local, int8):
        assert v["every_steps"] == 8
        assert v["programs"]["inner"]["slice"]["ops"] == {}
        assert v["programs"]["inner"]["data"]["flat_bytes"] > 0
        assert v["programs"]["sync"]["slice"]["flat_bytes"] > 0
        for kind in ("flat_bytes", "hierarchical_bytes"):
            assert v["ratio_to_mean"][kind] > 1, kind
    assert local["programs"]["sync"]["slice"]["ops"] == {"all-reduce f32": 1}
    assert any(op.startswith("all-to-all s8") for op in int8["programs"]["sync"]["slice"]["ops"])
    # int8 on the wire: fewer bytes over slice than the float32 sync of the same period.
    assert int8["per_step"]["slice"]["flat_bytes"] < local["per_step"]["slice"]["flat_bytes"] / 3
    # The trainer's logged bytes per step agree with the compiled sync program.
    for v in (local, int8):
        assert v["logged_bytes_per_step"] == pytest.approx(
            v["per_step"]["slice"]["hierarchical_bytes"], rel=0.01
        )
    # Against the hierarchical synchronous mean: H fewer bytes over slice, about 4H with int8
    # (each device of a slice syncs its quarter of the pseudo-gradient).
    assert local["ratio_to_mean"]["hierarchical_bytes"] == pytest.approx(8, rel=0.02)
    assert 3 * 8 < int8["ratio_to_mean"]["hierarchical_bytes"] <= 4 * 8


@pytest.mark.slow
def test_quality_runs_give_finite_losses_for_every_seed(results):
    q = results["quality"]
    assert set(q["variants"]) >= {"mean", "diloco H=8"}
    for name, v in q["variants"].items():
        assert v["runs"], name
        for run in v["runs"]:
            assert math.isfinite(run["train_loss"]) and math.isfinite(run["eval_loss"]), name
            assert 0 < run["eval_loss"] < math.log(128) + 1, name  # bytes: ln(128) at chance
        assert v["eval_loss"]["min"] <= v["eval_loss"]["mean"] <= v["eval_loss"]["max"]


@pytest.mark.slow
def test_every_program_was_timed_without_recompiling(results):
    t = results["timing"]
    assert set(t["programs"]) == {
        "mean step",
        "local_sgd H=8 inner",
        "local_sgd H=8 sync",
        "diloco_int8 H=8 inner",
        "diloco_int8 H=8 sync",
    }
    for name, p in t["programs"].items():
        assert p["median_ms"] > 0 and p["compiles_while_timed"] == 0, name
        assert p["vs_mean_step"]["paired_median"] > 0, name
    for name, a in t["amortized"].items():
        assert a["every_steps"] == 8 and a["per_step_ms"] > 0, name
