"""The schedule of step levels `Trainer.fit` follows, and the levels a run meets."""

import pytest

from trainers.core.step import HISTOGRAMS, LAYERS, PLAIN, STATS
from trainers.core.step_levels import levels_in_run, step_level

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
