"""Section: one executable for every kind of step, or one per kind (Levanter's way)?

A run has plain steps, statistics steps (every ``trainer.stats_every``) and logging steps
(per-layer norms every ``trainer.layer_stats_every``, histograms every
``trainer.histogram_every``), all computed inside the step from its own gradient. The trainer
can serve them from one executable, the differences under `lax.cond` on a traced level
(``step_executables="one"``), from two (plain and statistics steps / logging steps) or from
one per level (``"per_level"``, four, nothing traced). For each task, a fresh trainer per
design (its own compilations) runs steps of each level; all twelve loops are interleaved.

Reported per design: ms per step at each level, its ratio to the same level under "one"
(paired), the logging steps' cost relative to a plain step, what compiling cost (the
trainer's lower + compile seconds, and the trace/compile events of the first calls), and each
executable's temporary and output memory and HLO size.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import LEVEL_NAMES, Bench
from benchmarks.timing import interleave, ratio
from benchmarks.workloads import SMALL_TASKS

DESIGNS = ("one", "two", "per_level")


def run(bench: Bench) -> dict[str, Any]:
    """Returns the step times, compile costs and memory of every design, per task."""
    out: dict[str, Any] = {"designs": list(DESIGNS), "levels": list(LEVEL_NAMES)}
    for task in SMALL_TASKS:
        names = [f"{d}/{lv}" for d in DESIGNS for lv in LEVEL_NAMES]
        loops = {name: bench.loop(task, name) for name in names}  # first calls compile
        timings = interleave(list(loops.values()), bench.settings.plan(task))
        per_design = {}
        for design in DESIGNS:
            trainer = loops[f"{design}/plain"].trainer
            first = [loops[f"{design}/{lv}"].first_call for lv in LEVEL_NAMES]
            t = {lv: timings[f"{design}/{lv}"] for lv in LEVEL_NAMES}
            per_design[design] = {
                "variants": {lv: t[lv].summary() for lv in LEVEL_NAMES},
                "vs_one": {lv: ratio(t[lv], timings[f"one/{lv}"]) for lv in LEVEL_NAMES},
                "vs_plain_step": {lv: ratio(t[lv], t["plain"]) for lv in LEVEL_NAMES},
                "executables": len(trainer.executables()),
                "compile": {
                    "trainer_compile_s": round(trainer.compile_seconds or 0.0, 4),
                    "first_calls_wall_s": round(sum(f["wall_s"] for f in first), 4),
                    "traces": sum(f["traces"] for f in first),
                    "compiles": sum(f["compiles"] for f in first),
                    "backend_compile_s": round(sum(f["compile_s"] for f in first), 4),
                },
                "programs": {
                    "+".join(str(lv) for lv in group): _program(compiled)
                    for group, compiled in trainer.executables().items()
                },
            }
        out[task] = per_design
    return out


def _program(compiled: Any) -> dict[str, int | None]:
    """Temporary and output memory of one executable, and its HLO's size (None where the
    backend reports nothing)."""
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "output_bytes": getattr(mem, "output_size_in_bytes", None),
        "hlo_chars": len(compiled.as_text()),
    }
