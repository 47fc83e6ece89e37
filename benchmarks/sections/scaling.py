"""Section 7: step time on 1, 2, 4, 8 devices with the same global batch.

Meshes over the first n devices. On simulated CPU devices every "device" shares the same few
cores, so more devices cannot make a step faster: this shows what splitting the batch and
adding collectives costs, for xshard's trainer and for the hand-written ``jit`` step alike.
On real accelerators the same code measures speed-up.
"""

from __future__ import annotations

from typing import Any

from benchmarks.context import Bench
from benchmarks.timing import interleave, ratio
from benchmarks.variants import StepLoop
from benchmarks.workloads import SMALL_TASKS, device_counts

VARIANTS = ("xshard_trainer", "jit_gspmd")


class Renamed:
    """A step loop under another name (the timer keys results by name)."""

    def __init__(self, name: str, loop: StepLoop):
        self.name, self.loop = name, loop

    def run(self, steps: int) -> None:
        self.loop.run(steps)


def run(bench: Bench) -> dict[str, Any]:
    """Returns step times per device count, and xshard's ratio to ``jit`` at each count."""
    counts = bench.settings.device_counts(device_counts())
    out: dict[str, Any] = {
        "device_counts": counts,
        "note": "simulated CPU devices share the host's cores: overhead, not speed-up"
        if bench.mesh().devices.flat[0].platform == "cpu"
        else "accelerator devices",
    }
    for task in [t for t in SMALL_TASKS if t in bench.settings.tasks]:
        loops = [
            Renamed(f"{name}@{n}", bench.loop(task, name, n)) for n in counts for name in VARIANTS
        ]
        timings = interleave(loops, bench.settings.plan(task, "scaling"))
        rows = []
        for n in counts:
            xs, jit = timings[f"xshard_trainer@{n}"], timings[f"jit_gspmd@{n}"]
            rows.append(
                {
                    "devices": n,
                    "per_device_batch": bench.workload(task).global_batch_size // n,
                    "xshard_trainer": xs.summary(),
                    "jit_gspmd": jit.summary(),
                    "xshard_vs_jit": ratio(xs, jit),
                }
            )
        out[task] = rows
    return out
