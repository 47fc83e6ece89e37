"""A population: the trials of a sweep that differ only in their float hyperparameters, each
trained by its own `trainers.core.trainer.Trainer` (its own hooks, checkpoints, run dir), whose
steps run together as one program, vmapped over a leading trial axis.

Each trial runs its loop in its own thread and takes a `PopulationSeat`; its `StepPrograms`
hand every step to `Population.run` instead of running it alone. A step is a round: once every
trial still in the population has handed its step in, the last one to arrive runs the
population's program of that kind of step (one compiled program per `ProgramKey`, for all the
trials) and hands each trial its new state and its metrics. The program stacks the trials'
states and hyperparameters on a leading axis inside, runs the step function under `jax.vmap`
(the batch shared: the trials have one seed and one data order) and unstacks the results, so
every trial keeps a state of its own, as it would alone.

A trial that ends (its last step, early stopping, a non-finite loss, an error) leaves the
population (`Population.leave`): its slot is frozen, fed its last state, its results dropped,
so the program of the others never changes shape or compiles again. The programs donate
nothing (a frozen trial's state is still its thread's).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainers.core.metrics import StepMetrics, pack_diagnostics, stack_metrics
from trainers.core.step.programs import CompiledSteps, ProgramKey, StepPrograms, Traced
from trainers.core.step.types import TrainState, state_shardings
from xshard.stats.layers import leaf_names


class Handed(NamedTuple):
    """A trial's step, handed in for a round."""

    programs: StepPrograms
    key: ProgramKey
    state: TrainState
    batch: dict[str, jax.Array]


class PopulationSeat(NamedTuple):
    """A trial's place in a `Population`: what its `StepPrograms` run their steps through."""

    population: Population
    trial: int

    def run(
        self, programs: StepPrograms, key: ProgramKey, state: TrainState, batch: dict[str, Any]
    ) -> tuple[TrainState, StepMetrics]:
        """`Population.run` of this trial's step."""
        return self.population.run(self.trial, Handed(programs, key, state, batch))

    @property
    def compile_seconds(self) -> float | None:
        """The seconds the population spent compiling so far (None before the first)."""
        return self.population.compile_seconds

    def expect(self, keys: Iterable[ProgramKey]) -> None:
        """The kinds of step this trial's run will meet: compiled together, at the first round
        that needs one of them."""
        self.population.expect(keys)


@dataclasses.dataclass
class Population:
    """`size` trials whose steps run as one vmapped program per kind of step (module doc).

    Attributes:
      size: the number of trials.
      compile_seconds: the seconds spent compiling the population's programs (None: none).
      stepping: set once a trial handed in its first step or left: what it compiled to start
        (its initial state, its evaluation) is then in the compilation cache, for the others.
    """

    size: int
    compile_seconds: float | None = None
    stepping: threading.Event = dataclasses.field(default_factory=threading.Event)
    _cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    _active: set[int] = dataclasses.field(default_factory=set)
    _handed: dict[int, Handed] = dataclasses.field(default_factory=dict)
    _last: dict[int, Handed] = dataclasses.field(default_factory=dict)
    _results: dict[int, Any] = dataclasses.field(default_factory=dict)
    _compiled: CompiledSteps = dataclasses.field(default_factory=CompiledSteps)
    _expected: set[ProgramKey] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self._active = set(range(self.size))

    def seat(self, index: int) -> PopulationSeat:
        """The seat of trial `index` (0 .. size - 1)."""
        if not 0 <= index < self.size:
            raise ValueError(f"no trial {index} in a population of {self.size}")
        return PopulationSeat(self, index)

    def run(self, index: int, handed: Handed) -> tuple[TrainState, StepMetrics]:
        """Hands trial `index`'s step in and waits for its round; returns its new state and
        metrics. The last trial to arrive runs the round.

        Raises:
          RuntimeError: if the trials still training ask for different kinds of step in one
            round (they resumed from different steps), or what the round raised.
        """
        with self._cond:
            if index not in self._active:
                raise RuntimeError(f"trial {index} left the population and cannot step again")
            self._handed[index] = handed
            self.stepping.set()
            self._maybe_run_round()
            while index not in self._results:
                self._cond.wait()
            result = self._results.pop(index)
        if isinstance(result, BaseException):
            raise result
        return result

    def expect(self, keys: Iterable[ProgramKey]) -> None:
        """Kinds of step a trial will meet (`PopulationSeat.expect`)."""
        with self._cond:
            self._expected.update(keys)

    def leave(self, index: int) -> None:
        """Trial `index` steps no more: its slot is frozen; a round waiting only for it runs."""
        with self._cond:
            self._active.discard(index)
            self._handed.pop(index, None)
            self.stepping.set()
            self._maybe_run_round()

    def _maybe_run_round(self) -> None:
        """Runs the round once every active trial has handed its step in (lock held)."""
        if not self._handed or set(self._handed) != self._active:
            return
        handed, self._handed = self._handed, {}
        try:
            results: dict[int, Any] = self._round(handed)
        except Exception as error:  # every waiting trial raises it
            results = dict.fromkeys(handed, error)
        self._results.update(results)
        self._cond.notify_all()

    def _round(self, handed: dict[int, Handed]) -> dict[int, tuple[TrainState, StepMetrics]]:
        """Runs one step of every trial in `handed`, the others' slots frozen."""
        keys = {h.key for h in handed.values()}
        if len(keys) > 1:
            raise RuntimeError(
                f"the trials of a population ask for different kinds of step in one round "
                f"({sorted(keys)}): they must train in lockstep from the same step"
            )
        self._last.update(handed)
        lead = next(iter(handed.values()))
        slots = [self._last.get(i, lead) for i in range(self.size)]  # frozen: their last
        key = lead.key
        if self._compiled.get(key) is None:  # with the others expected, concurrently
            missing = {k for k in self._expected | {key} if self._compiled.get(k) is None}
            seconds = self._compiled.compile_concurrently(
                sorted(missing),
                lambda k: self._lower(k, slots),
                tuple(leaf_names(lead.state.params)),
            )
            self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        executable = self._compiled.get(key)
        assert executable is not None
        states, values = executable(
            tuple(s.state for s in slots),
            lead.batch,
            tuple(s.programs.hyperparams for s in slots),
        )
        return {i: (states[i], self._compiled.metrics(key.level, values[i])) for i in handed}

    def _lower(self, key: ProgramKey, slots: list[Handed]) -> Traced:
        """Traces and lowers the population's program of `key` (module doc)."""
        lead = slots[0].programs
        names: list[tuple[str, ...]] = []
        layouts: list[dict[str, tuple[int, ...]]] = []
        stats_keys: list[frozenset[str]] = []

        def one(state: TrainState, batch: Any, hyperparams: Mapping[str, Any]) -> Any:
            step_fn = lead.step_fn(key, hyperparams)
            state, metrics, diag = step_fn.fn(state, batch)
            stats_keys.append(frozenset(step_fn.stats_keys))
            keys, values = stack_metrics(metrics)
            names.append(keys)
            shapes, tail = pack_diagnostics(diag)
            layouts.append(shapes)
            return state, jnp.concatenate([values, tail])

        def program(states: tuple[Any, ...], batch: Any, hyperparams: tuple[Any, ...]) -> Any:
            stack = lambda *xs: jnp.stack(xs)
            stacked, inputs = jax.tree.map(stack, *states), jax.tree.map(stack, *hyperparams)
            new, values = jax.vmap(one, in_axes=(0, None, 0))(stacked, batch, inputs)
            unstacked = tuple(jax.tree.map(lambda x, i=i: x[i], new) for i in range(self.size))
            return unstacked, tuple(values[i] for i in range(self.size))

        shardings = tuple(state_shardings(s.state) for s in slots)
        replicated = tuple(
            jax.tree.map(lambda x: x.sharding, s.programs.hyperparams) for s in slots
        )
        jitted = jax.jit(
            program,
            in_shardings=(shardings, lead.batch_sharding, replicated),
            out_shardings=(shardings, None),
        )
        states = tuple(s.state for s in slots)
        hyperparams = tuple(s.programs.hyperparams for s in slots)
        with jax.set_mesh(lead.mesh):
            lowered = jitted.lower(states, slots[0].batch, hyperparams)
        return Traced(lowered, names[0], layouts[0], stats_keys[0])
