"""The compiled step programs of a run (`CompiledSteps`, by `ProgramKey`: a step's level and
whether it is a periodic axis's warm-up step), the kinds of step a run will meet
(`keys_in_run`) and what tracing a program recorded to read its results (`Traced`: the metric
names, the per-layer statistics' layouts). `trainers.core.step.programs.StepPrograms` lowers,
compiles and dispatches them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax

from trainers.core.metrics import StepMetrics
from trainers.core.step.levels import HISTOGRAMS, LAYERS, LEVELS, PLAIN, levels_in_run
from trainers.core.stop_vote import STOP_VOTE_KEY

logger = logging.getLogger(__name__)


class Traced(NamedTuple):
    """A lowered step program and what its tracing recorded."""

    lowered: jax.stages.Lowered
    keys: tuple[str, ...]  # the metric names, in the order of the metrics vector
    layouts: dict[str, tuple[int, ...]]  # the per-layer statistics' shapes after them
    stats_keys: frozenset[str]  # the metrics only statistics steps compute


class ProgramKey(NamedTuple):
    """Which program runs a step: its level (`trainers.core.step.levels.LEVELS`) and whether it is
    a warm-up step of a periodic axis (`trainers.core.periodic.axis.Periodic.warmup_tx`)."""

    level: int
    warmup: bool = False


def keys_in_run(
    first: int, num_steps: int, warmup_steps: int, periods: dict[str, int]
) -> frozenset[ProgramKey]:
    """The programs that steps `first` .. `num_steps` of a run run: the levels of its steps
    (`levels_in_run` with `periods`), as warm-up programs for steps 1 .. `warmup_steps` (a
    periodic axis's warm-up, 0: none)."""
    warm = levels_in_run(first, num_steps, last=warmup_steps, **periods)
    rest = levels_in_run(max(first, warmup_steps + 1), num_steps, **periods)
    return frozenset(ProgramKey(lv, True) for lv in warm) | {ProgramKey(lv) for lv in rest}


class CompiledSteps:
    """The compiled step programs of a run, by `ProgramKey`, and how to read their metrics."""

    def __init__(self) -> None:
        self._compiled: dict[ProgramKey, jax.stages.Compiled] = {}
        self._layouts: dict[int, dict[str, tuple[int, ...]]] = {}  # by level
        self._metric_keys: tuple[str, ...] = ()
        self._stats_keys: frozenset[str] = frozenset()
        self._leaf_names: tuple[str, ...] = ()

    def get(self, key: ProgramKey) -> jax.stages.Compiled | None:
        """The compiled program of `key`, or None."""
        return self._compiled.get(key)

    def by_level(self, warmup: bool = False) -> dict[int, jax.stages.Compiled]:
        """The compiled programs of the (warm-up) steps, by level, lowest first."""
        return {
            lv: self._compiled[ProgramKey(lv, warmup)]
            for lv in LEVELS
            if ProgramKey(lv, warmup) in self._compiled
        }

    def compile_concurrently(
        self,
        keys: Sequence[ProgramKey],
        lower: Callable[[ProgramKey], Traced],
        leaf_names: tuple[str, ...],
    ) -> float:
        """Lowers the programs of `keys` one after another (tracing holds the GIL), then
        compiles them concurrently, one thread each (XLA compiles without it); returns the
        seconds it took. `leaf_names` names the params' leaves (per-layer statistics)."""
        start = time.perf_counter()
        traced = {key: lower(key) for key in keys}
        if len(traced) == 1:
            compiled = {key: t.lowered.compile() for key, t in traced.items()}
        else:
            with ThreadPoolExecutor(len(traced), thread_name_prefix="xshard-compile") as pool:
                futures = {key: pool.submit(t.lowered.compile) for key, t in traced.items()}
                compiled = {key: future.result() for key, future in futures.items()}
        seconds = time.perf_counter() - start
        for key, t in traced.items():
            if self._metric_keys and t.keys != self._metric_keys:  # one metric layout for all
                raise AssertionError(f"metric keys differ between executables: {t.keys}")
            self._metric_keys = t.keys
            self._layouts[key.level] = t.layouts
            self._stats_keys = t.stats_keys
            self._compiled[key] = compiled[key]
        self._leaf_names = leaf_names
        logger.info(
            "Compiled the %strain step for level%s %s in %.2f s.",
            "warm-up " if any(key.warmup for key in traced) else "",
            "s" if len(traced) > 1 else "",
            ", ".join(str(key.level) for key in traced),
            seconds,
        )
        return seconds

    def metrics(self, level: int, values: Any) -> StepMetrics:
        """The `StepMetrics` of a step of `level` from its program's metrics vector."""
        hidden = (self._stats_keys if level == PLAIN else frozenset()) | {STOP_VOTE_KEY}
        return StepMetrics(
            self._metric_keys,
            values,
            hidden=hidden,
            diag=self._layouts[level] if level >= LAYERS else None,
            diag_names=self._leaf_names,
            histograms=level == HISTOGRAMS,
        )
