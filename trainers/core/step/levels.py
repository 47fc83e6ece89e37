"""The step levels: what each computes, which level each step of a run has, which levels a run
meets.

A step's *level* (plain, statistics, per-layer norms, histograms: `LEVELS`) is what it computes
besides the update (`trainers.core.step.train_step`), and `LevelFlags` which statistics that takes.
`step_level` is the schedule `Trainer.fit` follows, from the periods of ``trainer.stats_every``,
``trainer.layer_stats_every`` and ``trainer.histogram_every``; `levels_in_run` the levels a run
will meet, so that their programs (one per level, `trainers.Trainer`) are compiled before its
first step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: Step levels: what a step computes besides the update (each includes the ones below).
PLAIN, STATS, LAYERS, HISTOGRAMS = 0, 1, 2, 3
LEVELS = (PLAIN, STATS, LAYERS, HISTOGRAMS)


class LevelFlags(NamedTuple):
    """The statistics flags of a step's level, the keyword arguments of the optimizer's
    phases (`xshard.cross_shard`)."""

    #: From level 1: max |g|, the update/param norms, the per-shard statistics.
    with_stats: bool
    #: From level 2: the gradient's per-leaf norms (a reduction per leaf, which statistics
    #: steps skip: their global norm and max |g| are one reduction each over the packed
    #: gradient).
    layer_norms: bool
    #: At level 3: the gradient's per-leaf histograms.
    histograms: bool


def level_flags(level: int) -> LevelFlags:
    """The statistics flags for a step of `level`, decided when tracing.

    Args:
      level: one of `LEVELS`.

    Returns:
      The `LevelFlags`: each holds from its level up.
    """
    return LevelFlags(
        with_stats=level >= STATS, layer_norms=level >= LAYERS, histograms=level >= HISTOGRAMS
    )


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


def levels_in_run(
    first: int, num_steps: int, *, last: int | None = None, **periods: int
) -> frozenset[int]:
    """The levels of steps `first` .. `last` (default `num_steps`) of a run of `num_steps`
    (`step_level`'s keyword `periods`).

    The schedule repeats with the least common multiple of the periods, so at most one period
    and the run's last step are looked at.
    """
    last = num_steps if last is None else min(last, num_steps)
    if first > last:
        return frozenset()
    active = [p for p in periods.values() if p > 0]
    period = math.lcm(*active) if active else 1
    steps = [*range(first, min(last + 1, first + period)), last]
    return frozenset(step_level(s, num_steps, **periods) for s in steps)
