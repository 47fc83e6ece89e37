"""Section 3: the collectives each compiled step runs, read from its optimized HLO.

For every step variant: the number of collective instructions per step, how many of them carry
gradients and in how many operands, and the scalar collectives (loss, per-shard norm
statistics). The target is one gradient collective per dtype (a combined all-reduce), not one
per parameter.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import Bench
from benchmarks.hlo import collectives

VARIANTS = ("xshard_trainer", "xshard_trainer_gspmd", "xshard_nostats", "jit_gspmd", "pmap_pmean")


def run(bench: Bench) -> dict[str, Any]:
    """Returns, per task and variant, the collectives of the compiled step."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        per_variant = {}
        for name in VARIANTS:
            loop = bench.loop(task, name)
            found = collectives(
                loop.executable(), loop.params(loop.state), pmapped=name == "pmap_pmean"
            )
            totals = found["totals"]
            per_dtype = totals["gradient_ops_per_dtype"]
            found["gradient_reduction_fused"] = bool(per_dtype) and all(
                v == 1 for v in per_dtype.values()
            )
            per_variant[name] = found
        out[task] = per_variant
    return out
