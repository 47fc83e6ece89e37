"""Section 1: xshard's step against the fastest hand-written step, same model and batch.

Reports each variant's step time (median and spread) and the ratio of each xshard variant to
the fastest hand-written one (``jit_gspmd`` or ``pmap_pmean``), against `benchmarks.goals`, with
both gradient paths at the CLI's statistics cadence side by side (``paths``, and which one
is the CLI's default: ``default_grad_impl``, from the composed config; with ``auto``, the path
that the trainer's own start-up race keeps on this workload, `trainers.core.path_race`:
``default``), with the kernels of each compiled program by origin
(`benchmarks.hlo.program_breakdown`), which is where a gap comes from when the model is small.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import Bench
from benchmarks.goals import ALL_STATS, DEFAULT_STEP
from benchmarks.hlo import program_breakdown
from benchmarks.sections.steps import PATHS, STEP_VARIANTS, step_timings
from benchmarks.timing import ratio
from benchmarks.variants import HANDWRITTEN
from trainers.core.path_race import race


def default_path(bench: Bench, task: str) -> dict[str, Any]:
    """The path the CLI's default runs on `task`: the configured one, or with ``auto`` the one
    the trainer's start-up race keeps here (run as the CLI runs it, on both paths' trainers),
    with the race's timings and wall time."""
    impl = str(bench.workload(task).cfg.trainer.grad_impl)
    if impl != "auto":
        return {"grad_impl": impl, "race": None}
    trainers = {name: bench.trainer(task, grad_impl=name) for name in PATHS}
    state = trainers["manual"].init(bench.initial_params(task))
    batch = trainers["manual"].global_batch(bench.workload(task).host_batches[0])
    found = race(trainers, state, batch)
    return {"grad_impl": found.chosen, "race": found._asdict()}


def run(bench: Bench) -> dict[str, Any]:
    """Times the step variants of every task; returns step times and ratios."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        timings = step_timings(bench, task)
        fastest = min(HANDWRITTEN, key=lambda n: timings[n].summary()["median_ms"])
        xshard = [n for n in STEP_VARIANTS if n not in HANDWRITTEN]
        ratios = {n: ratio(timings[n], timings[fastest]) for n in xshard}
        default = default_path(bench, task)
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
            "default": {**default, "ratio": ratios[PATHS[default["grad_impl"]]]},
            "ratio_to_fastest_handwritten": ratios,
            "ratio_to_each_handwritten": each,
            "targets": {"default_step": DEFAULT_STEP[task], "all_stats": ALL_STATS},
        }
    return out
