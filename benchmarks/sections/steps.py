"""The timing group shared by the overhead and statistics sections.

One interleaved group per task holds every full-step variant, so that every ratio between
them (xshard vs hand-written, statistics vs none) comes from the same rounds.
"""

from __future__ import annotations

from benchmarks.context import Bench
from benchmarks.timing import Timing, interleave

#: The full-step variants of `benchmarks.variants`, timed together: both gradient paths at the
#: CLI's statistics cadence (`PATHS`) and with every statistic, the library alone, and the
#: hand-written steps.
STEP_VARIANTS = (
    "xshard_trainer",
    "xshard_trainer_stats10",
    "xshard_trainer_gspmd",
    "xshard_trainer_gspmd_stats10",
    "xshard_guard",
    "xshard_nostats",
    "jit_gspmd",
    "pmap_pmean",
)

#: ``trainer.grad_impl`` -> its variant at the CLI's cadence (statistics every 10th step).
PATHS = {"manual": "xshard_trainer_stats10", "gspmd": "xshard_trainer_gspmd_stats10"}


def step_timings(bench: Bench, task: str) -> dict[str, Timing]:
    """The interleaved timings of `STEP_VARIANTS` on `task` (measured once per run)."""

    def measure() -> dict[str, Timing]:
        loops = [bench.loop(task, name) for name in STEP_VARIANTS]
        return interleave(loops, bench.settings.plan(task))

    return bench.memo(("steps", task), measure)
