"""Which level each step of a run has, and which levels a run meets.

A step's *level* (`trainers.core.step`: plain, statistics, per-layer norms, histograms) is what it
computes besides the update. `step_level` is the schedule `Trainer.fit` follows, from the
periods of ``trainer.stats_every``, ``trainer.layer_stats_every`` and
``trainer.histogram_every``; `levels_in_run` the levels a run will meet, so that their
programs (one per level, `trainers.Trainer`) are compiled before its first step.
"""

from __future__ import annotations

import math

from trainers.core.step import HISTOGRAMS, LAYERS, PLAIN, STATS


def step_level(
    step: int,
    num_steps: int,
    *,
    stats_every: int,
    layer_stats_every: int,
    histogram_every: int,
) -> int:
    """The level of `step` (1-based) in a run of `num_steps`.

    Histogram steps every `histogram_every`, per-layer steps every `layer_stats_every`,
    statistics steps every `stats_every` and at the last step; 0 disables a period.
    """
    if histogram_every > 0 and step % histogram_every == 0:
        return HISTOGRAMS
    if layer_stats_every > 0 and step % layer_stats_every == 0:
        return LAYERS
    if step == num_steps or (stats_every > 0 and step % stats_every == 0):
        return STATS
    return PLAIN


def levels_in_run(first: int, num_steps: int, **periods: int) -> frozenset[int]:
    """The levels of steps `first` .. `num_steps` (`step_level`'s keyword `periods`).

    The schedule repeats with the least common multiple of the periods, so at most one period
    and the last step are looked at.
    """
    if first > num_steps:
        return frozenset()
    active = [p for p in periods.values() if p > 0]
    period = math.lcm(*active) if active else 1
    last = min(num_steps, first + period)
    steps = [*range(first, last), num_steps]
    return frozenset(step_level(s, num_steps, **periods) for s in steps)
