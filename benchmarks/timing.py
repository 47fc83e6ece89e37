"""Interleaved block timing: medians, spreads and paired ratios of step times.

Every compared variant runs blocks of `steps_per_block` steps, dispatched asynchronously and
ended by one ``block_until_ready``: timing blocks rather than single steps keeps per-step host
syncs out of the numbers, and bounding the block keeps few steps in flight (XLA:CPU
collectives deadlock with dozens of steps queued, see docs/development.md). Variants take turns
block by block (A B C, B C A, C A B, ...: the order rotates each round so no variant always
follows the same neighbour), so slow drifts of a shared, noisy machine hit all of them alike.
Warm-up blocks (the first includes compilation) are excluded.

Ratios are given two ways: the ratio of the medians, and the median of the per-round ratios
(A's block over B's block of the same round), whose spread shows how stable the comparison is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from benchmarks.compile_events import CompileEvents


class Steppable(Protocol):
    """Anything the timer can drive: runs `steps` steps and blocks until they are done."""

    name: str

    def run(self, steps: int) -> None:
        """Dispatches `steps` steps, then blocks until the last one's outputs are ready."""
        ...


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long to time: warm-up blocks, timed rounds, and steps per block."""

    warmup_blocks: int
    rounds: int
    steps_per_block: int


@dataclasses.dataclass
class Timing:
    """The per-step times (seconds) of one variant, one sample per timed block."""

    name: str
    samples: list[float]
    steps_per_block: int
    compiles_while_timed: int = 0

    def summary(self) -> dict[str, float | int]:
        """Median, quartiles, IQR, min and max in milliseconds per step."""
        return summarize_ms(self.samples) | {
            "blocks": len(self.samples),
            "steps_per_block": self.steps_per_block,
            "compiles_while_timed": self.compiles_while_timed,
        }


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, IQR, min and max of `samples_s` (seconds), in milliseconds."""
    x = np.asarray(samples_s, dtype=np.float64) * 1e3
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    return {
        "median_ms": round(float(med), 4),
        "q1_ms": round(float(q1), 4),
        "q3_ms": round(float(q3), 4),
        "iqr_ms": round(float(q3 - q1), 4),
        "min_ms": round(float(x.min()), 4),
        "max_ms": round(float(x.max()), 4),
    }


def ratio(a: Timing, b: Timing) -> dict[str, float]:
    """How many times slower `a` is than `b`: ratio of medians and paired per-round ratios.

    The two must come from the same `interleave` call, so that sample i of both is round i.
    """
    per_round = np.asarray(a.samples) / np.asarray(b.samples)
    q1, med, q3 = np.percentile(per_round, [25, 50, 75])
    return {
        "ratio_of_medians": round(float(np.median(a.samples) / np.median(b.samples)), 4),
        "paired_median": round(float(med), 4),
        "paired_q1": round(float(q1), 4),
        "paired_q3": round(float(q3), 4),
    }


def interleave(loops: Sequence[Steppable], plan: Plan) -> dict[str, Timing]:
    """Times `loops` block by block, in rotating order; returns their `Timing` by name.

    Every loop first runs `plan.warmup_blocks` untimed blocks. Compilations seen while a timed
    block runs are counted (`Timing.compiles_while_timed`): anything but 0 means the step
    recompiled, and its time is not a steady-state time.
    """
    names = [loop.name for loop in loops]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be distinct, got {names}")
    for loop in loops:
        for _ in range(plan.warmup_blocks):
            loop.run(plan.steps_per_block)
    timings = {loop.name: Timing(loop.name, [], plan.steps_per_block) for loop in loops}
    for r in range(plan.rounds):
        k = r % len(loops)
        for loop in [*loops[k:], *loops[:k]]:
            with CompileEvents() as events:
                start = time.perf_counter()
                loop.run(plan.steps_per_block)
                elapsed = time.perf_counter() - start
            t = timings[loop.name]
            t.samples.append(elapsed / plan.steps_per_block)
            t.compiles_while_timed += events.compiles
    return timings
