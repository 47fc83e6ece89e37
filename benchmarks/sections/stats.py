"""Section 2: what the statistics cost.

* Every-step statistics: `Trainer.step` (full statistics) against the same reduction with
  none (``xshard_nostats``: `cross_shard(track_stats=False)` in shard_map, loss only), with
  ``xshard_guard`` (the non-finite guard, which needs the reduced gradient's summary) between
  them.
* Occasional diagnostics: a step that also returns per-layer norms of its own gradient and
  params (and optionally gradient histograms), fetched to the host as `Trainer.fit` does,
  against a `Trainer.step` with statistics and against the fastest hand-written step (in the
  same interleaved group), and what that adds on average at the configured periods.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import Bench
from benchmarks.sections.steps import step_timings
from benchmarks.timing import interleave, ratio
from benchmarks.variants import HANDWRITTEN

DIAG_VARIANTS = ("xshard_trainer", "xshard_trainer+layer_stats", "xshard_trainer+histograms")


def run(bench: Bench) -> dict[str, Any]:
    """Returns the statistics' cost per task."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        steps = step_timings(bench, task)
        full_vs_none = ratio(steps["xshard_trainer"], steps["xshard_nostats"])
        loops = [bench.loop(task, n) for n in (*DIAG_VARIANTS, *HANDWRITTEN)]
        diag = interleave(loops, bench.settings.plan(task))
        base = diag["xshard_trainer"]
        layer = ratio(diag["xshard_trainer+layer_stats"], base)
        hist = ratio(diag["xshard_trainer+histograms"], base)
        fastest = min(HANDWRITTEN, key=lambda n: diag[n].summary()["median_ms"])
        cfg = bench.workload(task).cfg.trainer
        every = _diagnostics_every(int(cfg.layer_stats_every), int(cfg.histogram_every))
        out[task] = {
            "every_step": {
                "variants": {
                    n: steps[n].summary()
                    for n in (
                        "xshard_trainer",
                        "xshard_trainer_stats10",
                        "xshard_guard",
                        "xshard_nostats",
                    )
                },
                "full_vs_none": full_vs_none,
                "stats_every_10_vs_none": ratio(
                    steps["xshard_trainer_stats10"], steps["xshard_nostats"]
                ),
                "full_vs_guard_only": ratio(steps["xshard_trainer"], steps["xshard_guard"]),
                "guard_vs_none": ratio(steps["xshard_guard"], steps["xshard_nostats"]),
            },
            "diagnostics": {
                "variants": {n: diag[n].summary() for n in (*DIAG_VARIANTS, *HANDWRITTEN)},
                "fastest_handwritten": fastest,
                "vs_fastest_handwritten": {n: ratio(diag[n], diag[fastest]) for n in DIAG_VARIANTS},
                "layer_stats_step_vs_step": layer,
                "histogram_step_vs_step": hist,
                "configured_every_steps": every,
                "amortized_overhead": (
                    round((hist["ratio_of_medians"] - 1.0) / every, 5) if every else 0.0
                ),
            },
        }
    return out


def _diagnostics_every(layer_every: int, hist_every: int) -> int:
    """Period of the costliest diagnostics `Trainer.fit` runs by default (0: never).

    `fit` runs one diagnostics pass on a step when either period divides it, with histograms
    when the histogram period does; with both at 100 (the default), that is every 100th step.
    """
    periods = [p for p in (layer_every, hist_every) if p > 0]
    return min(periods) if periods else 0
