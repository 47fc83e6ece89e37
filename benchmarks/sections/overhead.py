"""Section 1: xshard's step against the fastest hand-written step, same model and batch.

Reports each variant's step time (median and spread) and the ratio of each xshard variant to
the fastest hand-written one (``jit_gspmd`` or ``pmap_pmean``), against `benchmarks.goals`, with
both gradient paths at the CLI's statistics cadence side by side (``paths``, and which one
is the CLI's default: ``default_grad_impl``, from the composed config), with
the kernels of each compiled program by origin (`benchmarks.hlo.program_breakdown`), which is
where a gap comes from when the model is small.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import Bench
from benchmarks.goals import ALL_STATS, DEFAULT_STEP
from benchmarks.hlo import program_breakdown
from benchmarks.sections.steps import PATHS, STEP_VARIANTS, step_timings
from benchmarks.timing import ratio
from benchmarks.variants import HANDWRITTEN


def run(bench: Bench) -> dict[str, Any]:
    """Times the step variants of every task; returns step times and ratios."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        timings = step_timings(bench, task)
        fastest = min(HANDWRITTEN, key=lambda n: timings[n].summary()["median_ms"])
        xshard = [n for n in STEP_VARIANTS if n not in HANDWRITTEN]
        ratios = {n: ratio(timings[n], timings[fastest]) for n in xshard}
        each = {
            hw: {n: ratio(timings[n], timings[hw]) for n in STEP_VARIANTS if n != hw}
            for hw in HANDWRITTEN
        }
        out[task] = {
            "model": bench.workload(task).model_config(),
            "devices": bench.max_devices,
            "variants": {n: timings[n].summary() for n in STEP_VARIANTS},
            "program": {
                n: program_breakdown(bench.loop(task, n).executable()) for n in STEP_VARIANTS
            },
            "fastest_handwritten": fastest,
            "default_grad_impl": str(bench.workload(task).cfg.trainer.grad_impl),
            "paths": {impl: ratios[name] for impl, name in PATHS.items()},
            "ratio_to_fastest_handwritten": ratios,
            "ratio_to_each_handwritten": each,
            "targets": {"default_step": DEFAULT_STEP[task], "all_stats": ALL_STATS},
        }
    return out
