"""The schedule of step levels `Trainer.fit` follows, and the levels a run meets."""

import pytest

from trainers.core.step import HISTOGRAMS, LAYERS, PLAIN, STATS
from trainers.core.step.compiled import ProgramKey, keys_in_run
from trainers.core.step.levels import levels_in_run, step_level

PERIODS = {"stats_every": 10, "layer_stats_every": 100, "histogram_every": 100}


def test_levels_follow_the_periods_and_the_last_step_has_statistics():
    level = lambda s, n=300, **kw: step_level(s, n, **(PERIODS | kw))
    assert [level(s) for s in (1, 9, 10, 20, 99, 100, 200, 299, 300)] == [
        PLAIN,
        PLAIN,
        STATS,
        STATS,
        PLAIN,
        HISTOGRAMS,
        HISTOGRAMS,
        PLAIN,
        HISTOGRAMS,
    ]
    assert level(50, histogram_every=0, layer_stats_every=50) == LAYERS
    assert level(7, n=7) == STATS  # the last step always computes the statistics
    assert level(10, stats_every=0) == PLAIN


@pytest.mark.parametrize(
    "first,num_steps,periods",
    [
        (1, 300, PERIODS),
        (1, 9, PERIODS),
        (101, 150, PERIODS),
        (1, 1000, {"stats_every": 7, "layer_stats_every": 11, "histogram_every": 13}),
        (5, 40, {"stats_every": 0, "layer_stats_every": 0, "histogram_every": 0}),
        (3, 30, {"stats_every": 4, "layer_stats_every": 6, "histogram_every": 0}),
    ],
)
def test_levels_in_run_are_exactly_those_of_its_steps(first, num_steps, periods):
    every_step = {step_level(s, num_steps, **periods) for s in range(first, num_steps + 1)}
    assert levels_in_run(first, num_steps, **periods) == every_step


def test_levels_in_a_finished_run_are_none():
    assert levels_in_run(11, 10, **PERIODS) == frozenset()


@pytest.mark.parametrize("first,last,num_steps", [(1, 5, 300), (1, 150, 300), (90, 120, 300)])
def test_levels_up_to_a_step_are_those_of_its_steps(first, last, num_steps):
    every_step = {step_level(s, num_steps, **PERIODS) for s in range(first, last + 1)}
    assert levels_in_run(first, num_steps, last=last, **PERIODS) == every_step


@pytest.mark.parametrize(
    "first,num_steps,warmup", [(1, 300, 0), (1, 300, 20), (1, 15, 20), (31, 300, 20)]
)
def test_the_programs_of_a_run_split_its_warmup_steps_from_the_others(first, num_steps, warmup):
    """The programs `Trainer.fit` compiles before the first step: the level of each step,
    with a periodic axis's warm-up program for steps 1 .. warmup."""
    every_step = {
        ProgramKey(step_level(s, num_steps, **PERIODS), s <= warmup)
        for s in range(first, num_steps + 1)
    }
    assert keys_in_run(first, num_steps, warmup, PERIODS) == every_step
