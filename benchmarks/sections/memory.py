"""Section 4: device memory of each compiled step, and of the state it keeps.

``compiled.memory_analysis()`` gives bytes per device for the arguments (state + batch), the
outputs, the part of the outputs aliased to donated arguments, and temporaries. Params and
optimizer-state bytes per device are computed from the arrays' own shardings.
"""

from __future__ import annotations

from typing import Any

import jax

from benchmarks.context import Bench
from benchmarks.hlo import memory, state_bytes

VARIANTS = ("xshard_trainer", "xshard_trainer_gspmd", "xshard_nostats", "jit_gspmd", "pmap_pmean")


def run(bench: Bench) -> dict[str, Any]:
    """Returns, per task and variant, compiled memory stats and state bytes per device."""
    out: dict[str, Any] = {}
    for task in bench.settings.tasks:
        per_variant = {}
        for name in VARIANTS:
            loop = bench.loop(task, name)
            pmapped = name == "pmap_pmean"
            params = state_bytes(loop.params(loop.state), pmapped=pmapped)
            opt = state_bytes(loop.opt_state(loop.state), pmapped=pmapped)
            batch = state_bytes(loop.batches[0], pmapped=pmapped)
            per_variant[name] = {
                "compiled": memory(loop.executable()),
                "params_bytes_per_device": params["per_device_bytes"],
                "opt_state_bytes_per_device": opt["per_device_bytes"],
                "batch_bytes_per_device": batch["per_device_bytes"],
                "params_bytes_logical": params["logical_bytes"],
                "num_param_leaves": len(jax.tree.leaves(loop.params(loop.state))),
                "num_opt_state_leaves": len(jax.tree.leaves(loop.opt_state(loop.state))),
            }
        out[task] = per_variant
    return out
