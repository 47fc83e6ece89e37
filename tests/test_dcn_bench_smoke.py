"""The emulated-link benchmark still runs: ``python -m benchmarks.dcn --smoke``.

Two processes in two network namespaces joined by a tbf-limited veth pair (`benchmarks.netns`).
Checks structure and sanity (both variants measured, bytes over slice as logged, namespaces
removed on every way out), never how fast anything is. Skipped where namespaces cannot be made
(not root, no ``ip``/``tc``, no tbf).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks import netns
from benchmarks.dcn import goal
from tests import REPO

pytestmark = pytest.mark.long

UNAVAILABLE = netns.unavailable()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"{UNAVAILABLE}")


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@needs_netns
def test_the_link_is_removed_on_an_error_and_a_dead_owners_link_at_the_next_start():
    with pytest.raises(RuntimeError), netns.emulated_link() as link:
        link.set_rate("100mbit")
        made = link.namespaces
        assert set(made) <= set(_namespaces())
        raise RuntimeError("mid-run")
    assert not set(made) & set(_namespaces())
    # A link whose owner was killed before its cleanup ran: a process id that has ended.
    ended = subprocess.Popen(["true"])
    ended.wait()
    stale = netns.Link(str(ended.pid))
    stale.create()
    with netns.emulated_link() as link:
        assert not set(stale.namespaces) & set(_namespaces())
        assert set(link.namespaces) <= set(_namespaces())
    assert not (netns.ETC_NETNS / stale.namespaces[0]).exists()


def test_goal_names_each_rate_where_mean_is_3x_slower_than_compute():
    rows = [
        {"rate": "100mbit", "variant": "mean", "utilisation": 0.5},
        {"rate": "10mbit", "variant": "mean", "utilisation": 0.2},
        {"rate": "10mbit", "variant": "diloco H=8", "utilisation": 0.9},
        {"rate": "10mbit", "variant": "diloco H=32", "utilisation": 0.97},
    ]
    assert goal({"rows": rows}) == (
        "At 10mbit, `mean` runs at 0.20 of compute-bound throughput; the best DiLoCo variant, "
        "`diloco H=32`, at 0.97 (goal >= 0.95: met)."
    )
    assert "does not apply" in goal({"rows": rows[:1]})
    assert netns.rate_bytes_per_s("10mbit") == 1_250_000


@needs_netns
@pytest.mark.slow
@pytest.mark.multiprocess
def test_smoke_run_measures_both_variants_over_the_limited_link(tmp_path):
    out = tmp_path / "dcn.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.dcn", "--smoke", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert not [n for n in _namespaces() if n.startswith(f"{netns.PREFIX}{proc.pid}-")]
    assert out.with_suffix(".md").read_text().startswith("# DiLoCo on an emulated slow link")
    results = json.loads(out.read_text())
    assert results["meta"]["mode"] == "smoke" and results["compute"] == {}
    rows = {(r["rate"], r["variant"]): r for r in results["rows"]}
    assert set(rows) == {("10mbit", "mean"), ("10mbit", "diloco H=8")}
    for row in rows.values():
        assert row["ms_per_step"] > 0 and math.isfinite(row["ms_per_step"])
        assert len(row["windows_ms"]) == results["settings"]["windows"] - 1
    # What crosses slice: the synchronous mean every step, DiLoCo's sync every 8th.
    mean, diloco = rows["10mbit", "mean"], rows["10mbit", "diloco H=8"]
    assert mean["slice_bytes_per_step"] == pytest.approx(8 * diloco["slice_bytes_per_step"])
