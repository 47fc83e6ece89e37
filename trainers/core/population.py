"""A population: the trials of a sweep that differ only in their float hyperparameters, each
trained by its own `trainers.core.trainer.Trainer` (its own hooks, checkpoints, run dir), whose
steps run together as one program, vmapped over a leading trial axis.

Each trial runs its loop in its own thread and takes a `PopulationSeat`; its `StepPrograms`
hand every step to `Population.run` instead of running it alone. A step is a round: once every
trial still in the population has handed its step in, the last one to arrive runs the
population's program of that kind of step (one compiled program per `ProgramKey`, for all the
trials) and hands each trial its new state and its metrics. The population keeps the trials'
states stacked on a leading axis (stacked once, at the first round, with their
hyperparameters); its program runs the step function under `jax.vmap` over them (the batch
shared: the trials have one seed and one data order) and donates the stacked state; a small
jitted program unstacks each round's result into every trial's own state (its own shardings),
which its hooks, checkpoints and evaluation read as they would alone.

A trial that ends (its last step, early stopping, a non-finite loss, an error) leaves the
population (`Population.leave`): its slot still trains (the step is vmapped, so it cannot
touch the others), its results are dropped, and the others' program never changes shape or
compiles again.

Faults: the trials agree on the step they resume from (`Population.agree_resume`: the latest
step every trial saved, so a population killed between two trials' saves of one step resumes
every trial from the step before), and on when to stop: a stop request (`should_stop`, the
launcher's stop signal) is read once a round, after it ran, so every trial sees it after the
same step (`PopulationSeat.stop_signal`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.metrics import StepMetrics
from trainers.core.periodic.sync import PeriodicPrograms
from trainers.core.step.compiled import CompiledSteps, ProgramKey, Traced
from trainers.core.step.programs import StepPrograms
from trainers.core.step.types import TrainState, state_shardings
from xshard.stats.layers import leaf_names


class SyncKey(NamedTuple):
    """A round of a periodic axis's sync of `fragment` (`trainers.core.periodic.sync`)."""

    fragment: int


class Handed(NamedTuple):
    """A trial's step (or its periodic axis's sync: `SyncKey`, no batch), handed in for a
    round."""

    programs: StepPrograms | PeriodicPrograms
    key: ProgramKey | SyncKey
    state: TrainState
    batch: dict[str, jax.Array] | None


class PopulationSeat(NamedTuple):
    """A trial's place in a `Population`: what its `StepPrograms` run their steps through."""

    population: Population
    trial: int

    def run(
        self, programs: StepPrograms, key: ProgramKey, state: TrainState, batch: dict[str, Any]
    ) -> tuple[TrainState, StepMetrics]:
        """`Population.run` of this trial's step."""
        return self.population.run(self.trial, Handed(programs, key, state, batch))

    def sync(
        self, programs: PeriodicPrograms, fragment: int, state: TrainState
    ) -> tuple[TrainState, jax.Array]:
        """`Population.run` of this trial's sync of `fragment` (a periodic axis): its new
        state and its `xshard.reduce.periodic.SyncStats` vector."""
        return self.population.run(self.trial, Handed(programs, SyncKey(fragment), state, None))

    @property
    def compile_seconds(self) -> float | None:
        """The seconds the population spent compiling so far (None before the first)."""
        return self.population.compile_seconds

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The population's compiled step of the lowest level compiled so far (None: none
        yet): what its trials' ``perf/flops_per_sec`` is read from."""
        return self.population.compiled

    @property
    def trials(self) -> int:
        """The population's size: the trials its programs step at once."""
        return self.population.size

    @property
    def stop_signal(self) -> str | None:
        """The stop request the population read after its last round (a signal's name), or
        None: the same for every trial between two rounds."""
        return self.population.stop_signal

    def agree_resume(self, steps: Iterable[int]) -> int | None:
        """`Population.agree_resume` of this trial's saved `steps`."""
        return self.population.agree_resume(self.trial, steps)

    def expect(self, keys: Iterable[ProgramKey]) -> None:
        """The kinds of step this trial's run will meet: compiled together, at the first round
        that needs one of them."""
        self.population.expect(keys)


@dataclasses.dataclass
class Population:
    """`size` trials whose steps run as one vmapped program per kind of step (module doc).

    Attributes:
      size: the number of trials.
      should_stop: a stop request (a signal's name, or None), read after every round.
      compile_seconds: the seconds spent compiling the population's programs (None: none).
      stop_signal: what `should_stop` returned after a round, once it was not None.
      stepping: set once a trial handed in its first step or left: what it compiled to start
        (its initial state, its evaluation) is then in the compilation cache, for the others.
      saving: held by a trial while its checkpoint save starts (they take turns: Orbax's
        saves share process-wide state).
    """

    size: int
    should_stop: Callable[[], str | None] = lambda: None
    compile_seconds: float | None = None
    stop_signal: str | None = None
    stepping: threading.Event = dataclasses.field(default_factory=threading.Event)
    saving: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    _active: set[int] = dataclasses.field(default_factory=set)
    _handed: dict[int, Handed] = dataclasses.field(default_factory=dict)
    _results: dict[int, Any] = dataclasses.field(default_factory=dict)
    _saved: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    _resume: list[int | None] = dataclasses.field(default_factory=list)  # once agreed: [step]
    _compiled: CompiledSteps = dataclasses.field(default_factory=CompiledSteps)
    _syncs: dict[int, Any] = dataclasses.field(default_factory=dict)  # by fragment, compiled
    _expected: set[ProgramKey] = dataclasses.field(default_factory=set)
    _stacked: Any = None  # the trials' states on a leading axis, once the first round ran
    _inputs: Any = None  # their hyperparameters, likewise
    _shardings: Any = None  # the stacked state's
    _unstack: Any = None  # stacked state -> the trials' states (jitted)

    def __post_init__(self) -> None:
        self._active = set(range(self.size))

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The compiled step of the lowest level compiled so far (None: none yet)."""
        return next(iter(self._compiled.by_level().values()), None)

    def seat(self, index: int) -> PopulationSeat:
        """The seat of trial `index` (0 .. size - 1)."""
        if not 0 <= index < self.size:
            raise ValueError(f"no trial {index} in a population of {self.size}")
        return PopulationSeat(self, index)

    def run(self, index: int, handed: Handed) -> tuple[TrainState, Any]:
        """Hands trial `index`'s step (or sync) in and waits for its round; returns its new
        state and metrics (a sync: its statistics vector). The last trial to arrive runs the
        round.

        Raises:
          RuntimeError: if the trials start from different steps, or ask for different kinds
            of step in one round, or what the round raised.
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

    def agree_resume(self, index: int, steps: Iterable[int]) -> int | None:
        """Trial `index`'s saved `steps` (its own complete checkpoints); waits until every
        trial still in the population gave its own, then returns the latest step all of them
        saved (None: one saved none), the same for every trial. Then trials other than the
        first wait until it steps (`stepping`: their start-up programs are cached by then)."""
        with self._cond:
            self._saved[index] = frozenset(steps)
            self._cond.notify_all()
            while not self._resume and not self._active <= set(self._saved):
                self._cond.wait()
            if not self._resume:  # the first to see every trial's agrees for all
                common = frozenset.intersection(*self._saved.values())
                self._resume.append(max(common, default=None))
            agreed = self._resume[0]
        if index != 0:
            self.stepping.wait()
        return agreed

    def expect(self, keys: Iterable[ProgramKey]) -> None:
        """Kinds of step a trial will meet (`PopulationSeat.expect`)."""
        with self._cond:
            self._expected.update(keys)

    def leave(self, index: int) -> None:
        """Trial `index` steps no more: its slot's results are dropped; a round waiting only
        for it runs."""
        with self._cond:
            self._active.discard(index)
            self._handed.pop(index, None)
            self.stepping.set()
            self._cond.notify_all()  # a resume agreement waiting for it
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
        if self.stop_signal is None:  # read here: every trial sees it after this step
            self.stop_signal = self.should_stop()
        self._results.update(results)
        self._cond.notify_all()

    def _round(self, handed: dict[int, Handed]) -> dict[int, tuple[TrainState, StepMetrics]]:
        """Runs one step of every trial in `handed`; the others' slots are updated too (their
        results dropped)."""
        keys = {h.key for h in handed.values()}
        if len(keys) > 1:
            raise RuntimeError(
                f"the trials of a population ask for different kinds of step in one round "
                f"({sorted(keys, key=repr)}): they must train in lockstep from the same step"
            )
        lead = next(iter(handed.values()))
        if self._stacked is None:  # the first round: the trials' states, stacked once
            self._stack_trials(handed)
        if isinstance(lead.key, SyncKey):
            return self._sync_round(lead, handed)
        key = lead.key
        assert isinstance(key, ProgramKey)
        if self._compiled.get(key) is None:  # with the others expected, concurrently
            missing = {k for k in self._expected | {key} if self._compiled.get(k) is None}
            seconds = self._compiled.compile_concurrently(
                sorted(missing),
                lambda k: self._lower(k, lead),
                tuple(leaf_names(lead.state.params)),
            )
            self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        executable = self._compiled.get(key)
        assert executable is not None and self._unstack is not None
        self._stacked, values = executable(self._stacked, lead.batch, self._inputs)
        states = self._unstack(self._stacked)
        return {i: (states[i], self._compiled.metrics(key.level, values[i])) for i in handed}

    def _stack_trials(self, handed: dict[int, Handed]) -> None:
        """The first round: checks the trials start from one step, stacks their states and
        hyperparameters (a trial that left before: the lead's in its slot), and jits the
        unstacking of the stacked state into the trials' (their own shardings)."""
        steps = {i: int(jax.device_get(h.state.step)) for i, h in handed.items()}
        if len(set(steps.values())) > 1:
            raise RuntimeError(
                f"the trials of a population start from different steps ({steps}, by "
                "trial; resumed from different checkpoints?): they share one batch a step. "
                "Rerun them with Hydra's basic launcher."
            )
        lead = next(iter(handed.values()))
        slots = [handed.get(i, lead) for i in range(self.size)]
        start = time.perf_counter()
        trial = state_shardings(lead.state)
        self._shardings = jax.tree.map(_stacked_sharding, trial)
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        self._stacked = jax.jit(stack, out_shardings=self._shardings)([s.state for s in slots])
        programs = [s.programs for s in slots if isinstance(s.programs, StepPrograms)]
        assert len(programs) == self.size  # the first round is a step's
        self._inputs = jax.jit(stack)([p.hyperparams for p in programs])
        size = self.size
        unstack = lambda tree: tuple(jax.tree.map(lambda x, i=i: x[i], tree) for i in range(size))
        self._unstack = jax.jit(unstack, out_shardings=(trial,) * size)
        self._unstack(self._stacked)  # compiled now, timed with the stacking
        self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - start

    def _lower(self, key: ProgramKey, lead: Handed) -> Traced:
        """Traces and lowers the population's program of `key`: the step (every replica alone
        with a periodic axis: `StepPrograms.step_program`) vmapped over the stacked state and
        hyperparameters, the batch shared; the stacked state donated."""
        programs = lead.programs
        assert isinstance(programs, StepPrograms)
        seen: list[tuple[Any, ...]] = []
        one = programs.step_program(key, seen)

        def program(stacked: Any, batch: Any, inputs: Any) -> Any:
            new, values = jax.vmap(one, in_axes=(0, None, 0))(stacked, batch, inputs)
            return new, tuple(values[i] for i in range(self.size))

        jitted = jax.jit(
            program,
            in_shardings=(self._shardings, programs.batch_sharding, None),
            out_shardings=(self._shardings, None),
            donate_argnums=(0,),
        )
        with jax.set_mesh(programs.mesh):
            lowered = jitted.lower(self._stacked, lead.batch, self._inputs)
        names, layouts, stats_keys = seen[0]
        return Traced(lowered, names, layouts, frozenset(stats_keys))

    def _sync_round(self, lead: Handed, handed: dict[int, Handed]) -> dict[int, Any]:
        """A round of a periodic axis's sync (`SyncKey`): its program
        (`PeriodicPrograms.sync_program`) vmapped over the stacked state (inner and outer) and
        every trial's hyperparameters (its outer optimizer's among them), compiled at the
        fragment's first sync; the stacked state donated. Each trial gets its new state and
        its statistics vector."""
        programs, key = lead.programs, lead.key
        assert isinstance(programs, PeriodicPrograms) and isinstance(key, SyncKey)
        executable = self._syncs.get(key.fragment)
        if executable is None:
            start = time.perf_counter()
            sync = programs.sync_program(key.fragment)
            program = lambda stacked, inputs: jax.vmap(sync)(stacked, inputs)
            jitted = jax.jit(
                program,
                in_shardings=(self._shardings, None),
                out_shardings=(self._shardings, None),
                donate_argnums=(0,),
            )
            with jax.set_mesh(programs.periodic.mesh):
                executable = jitted.lower(self._stacked, self._inputs).compile()
            self._syncs[key.fragment] = executable
            self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - start
        assert self._unstack is not None
        self._stacked, values = executable(self._stacked, self._inputs)
        states = self._unstack(self._stacked)
        return {i: (states[i], values[i]) for i in handed}


def _stacked_sharding(sharding: Any) -> Any:
    """The sharding of a trial leaf's stack: the trial axis whole, the rest as the leaf's."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return None  # XLA chooses
