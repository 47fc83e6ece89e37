"""The performance targets the benchmark reports against (ratios; lower is better).

They are targets of the measurement, never timed assertions in tests. Each is a ratio of
median step times in one interleaved group (`benchmarks.timing`), so load on the machine
cancels out as far as it can.
"""

from __future__ import annotations

from typing import Any

#: What the CLI runs without overrides (``trainer.grad_impl=auto``: the path its start-up race
#: keeps, at the CLI's statistics cadence) against the fastest hand-written step (issue 38).
DEFAULT_STEP: dict[str, float] = {
    "mlp": 1.02,
    "tiny_gpt": 1.02,
    "gpt_4x128": 1.02,
    "gpt_8x256": 1.02,
}
#: Every statistic on every step (`xshard_trainer`) against the fastest hand-written step.
ALL_STATS = 1.10
#: Steps that also return per-layer norms and gradient histograms, against the same.
LOGGING_STEP = 1.15
#: `Trainer.fit` with the CLI's hooks against a bare Python loop over the same step.
HOST_LOOP = 1.02
#: Muon's step against AdamW's at the CLI's defaults (issue 36; section `optimizers`).
MUON_STEP = 1.10


def _row(what: str, task: str, target: float, r: dict[str, float] | None) -> dict[str, Any]:
    if r is None:
        return {"what": what, "task": task, "target": target, "measured": None, "met": None}
    return {
        "what": what,
        "task": task,
        "target": target,
        "measured": r["ratio_of_medians"],
        "paired": r["paired_median"],
        "met": r["ratio_of_medians"] <= target,
    }


def summary(sections: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target that the run measured: the ratio, its paired median, met or not."""
    rows = []
    overhead = sections.get("overhead", {})
    for task, t in overhead.items():
        if not isinstance(t, dict) or "ratio_to_fastest_handwritten" not in t:
            continue
        ratios = t["ratio_to_fastest_handwritten"]
        default = t.get("default", {}).get("ratio", ratios.get("xshard_trainer_stats10"))
        rows.append(_row("default step (CLI)", task, DEFAULT_STEP[task], default))
        rows.append(
            _row("every statistic, every step", task, ALL_STATS, ratios.get("xshard_trainer"))
        )
    stats = sections.get("stats", {})
    for task, t in stats.items():
        if not isinstance(t, dict) or "diagnostics" not in t:
            continue
        vs = t["diagnostics"].get("vs_fastest_handwritten", {})
        for name, what in (
            ("xshard_trainer+layer_stats", "+ per-layer norms, every step"),
            ("xshard_trainer+histograms", "+ histograms, every step"),
        ):
            rows.append(_row(what, task, LOGGING_STEP, vs.get(name)))
    for task, t in sections.get("optimizers", {}).items():
        if isinstance(t, dict) and "vs_adamw" in t:
            rows.append(
                _row("muon vs adamw (CLI defaults)", task, MUON_STEP, t["vs_adamw"]["muon"])
            )
    host = sections.get("host", {})
    if "fit_hooks_vs_bare" in host:
        rows.append(
            _row(
                "host loop: fit + hooks vs bare loop",
                host["task"],
                HOST_LOOP,
                host["fit_hooks_vs_bare"],
            )
        )
    return rows
