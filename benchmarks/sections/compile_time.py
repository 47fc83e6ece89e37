"""Section 5: the cost of the first step, and proof that later steps do not recompile.

* First call of every step variant: wall time (trace + lower + XLA compile + one execution)
  and the trace / lowering / compile events `jax.monitoring` saw (`CompileEvents`); for the
  trainer also its own `Trainer.compile_seconds` (lower + compile of the AOT step).
* Later steps: the compilations counted while `compile_check_steps` more steps run; they must
  be 0. The trainer calls an ahead-of-time `jax.stages.Compiled`, which cannot retrace or
  recompile: a batch of another shape is rejected with an error (checked here on a fresh
  state), never silently recompiled. The hand-written ``jax.jit`` step keeps one entry in its
  cache (``_cache_size()``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from benchmarks.compile_events import CompileEvents
from benchmarks.context import Bench
from benchmarks.sections.steps import STEP_VARIANTS


def run(bench: Bench) -> dict[str, Any]:
    """Returns first-call costs and the recompilation checks, per task and variant."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        per_variant = {}
        for name in STEP_VARIANTS:
            loop = bench.loop(task, name)
            with CompileEvents() as later:
                loop.run(bench.settings.compile_check_steps)
            entry = {
                "first_call": loop.first_call,
                "later_steps": bench.settings.compile_check_steps,
                "later_compiles": later.compiles,
                "later_traces": later.traces,
            }
            if loop.jitted is not None:
                entry["jit_cache_size"] = int(loop.jitted._cache_size())
            if loop.trainer is not None:
                entry["executable_type"] = type(loop.executable()).__qualname__
                entry["executables"] = len(loop.trainer.executables())
            per_variant[name] = entry
        out[task] = {
            "variants": per_variant,
            "shape_change": _shape_change(bench, task),
        }
    return out


def _shape_change(bench: Bench, task: str) -> dict[str, Any]:
    """Calls the trainer's step with half the batch: it must raise, not recompile."""
    trainer = bench.loop(task, "xshard_trainer").trainer
    wl = bench.workload(task)
    state = trainer.init(bench.initial_params(task))
    half = {k: v[: v.shape[0] // 2] for k, v in wl.host_batches[0].items()}
    error = None
    with CompileEvents() as events:
        try:
            jax.block_until_ready(trainer.step(state, half))
        except Exception as e:  # the error type is what we report
            lines = str(e).strip().splitlines() or [""]
            error = f"{type(e).__name__}: {lines[-1][:200]}"  # the last line names the mismatch
    return {
        "batch_rows": int(np.shape(next(iter(half.values())))[0]),
        "raised": error,
        "compiles": events.compiles,
    }
