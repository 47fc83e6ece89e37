"""A run's step programs: one per kind of step (`ProgramKey`: its level, and whether it is a
periodic axis's warm-up step), lowered, compiled and dispatched by `StepPrograms`; the kinds a
run will meet (`keys_in_run`); the compiled executables with what tracing recorded to read
their results (the metric names, the per-layer statistics' layouts: `CompiledSteps`).

A level's step function (`trainers.core.step.train_step`) becomes one jitted program that
donates the state, packs the metrics and per-layer statistics into one vector (one transfer to
the host), takes the highest stop vote of all devices (`trainers.core.stop_vote`) and, with a
periodic axis, runs every replica alone. The programs a run will meet are compiled together
before its first step (`StepPrograms.compile_run`; `compile_missing` for chosen kinds), any
other when a step first needs it, then dispatched by `StepPrograms.run`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.metrics import StepMetrics, pack_diagnostics, stack_metrics
from trainers.core.periodic.axis import Periodic
from trainers.core.precision import Precision
from trainers.core.step.compiled import CompiledSteps, ProgramKey, Traced, keys_in_run
from trainers.core.step.levels import LEVELS
from trainers.core.step.train_step import OptimizerInputs, make_train_step
from trainers.core.step.types import (
    StepSpec,
    TrainState,
    TrainStep,
    placed_inputs,
    state_shardings,
)
from trainers.core.stop_vote import STOP_VOTE_KEY
from trainers.core.zero import ZeroLayout
from trainers.tasks.base import Task
from xshard.errors import ConfigError
from xshard.optim.cross_shard import CrossShardTransformation
from xshard.reduce.gradients import PerShardGradientsRequired
from xshard.stats.layers import leaf_names

logger = logging.getLogger(__name__)


def step_functions(
    task: Task,
    tx: CrossShardTransformation,
    mesh: Mesh,
    spec: StepSpec,
    layout: ZeroLayout,
    precision: Precision,
    inputs: OptimizerInputs | None = None,
) -> dict[int, TrainStep]:
    """A step function per level (`make_train_step`, on `inputs` if given), for `StepPrograms`.

    Raises:
      ConfigError: for a `spec.grad_impl` that is not allowed.
    """
    return {
        lv: make_train_step(task, tx, mesh, spec, lv, layout, precision, inputs) for lv in LEVELS
    }


class StepInputs(NamedTuple):
    """The float hyperparameters the step programs take as inputs (`xshard.optim.hyperparams`):
    jobs that differ only in their values run the same programs.

    Attributes:
      values: their values for this run (Python numbers), by config key.
      step_fns: ``values -> (step functions, warm-up ones)``, by level: those of the
        optimizer built with `values` (float32 scalars traced in the program).
    """

    values: Mapping[str, float]
    step_fns: Callable[[Mapping[str, Any]], tuple[Mapping[int, TrainStep], Mapping[int, TrainStep]]]


@dataclasses.dataclass(frozen=True)
class StepFunctionSets:
    """A run's step functions by level (`step_functions`), and a periodic axis's warm-up ones,
    on an optimizer.

    Attributes:
      task, mesh, spec, layout, precision: as `step_functions`'s.
      warmup: the optimizer of the warm-up steps from the step's
        (`trainers.core.periodic.axis.Periodic.warmup_tx`); None: no warm-up steps.
    """

    task: Task
    mesh: Any
    spec: StepSpec
    layout: ZeroLayout
    precision: Precision
    warmup: Callable[[CrossShardTransformation], CrossShardTransformation] | None = None

    def __call__(
        self, tx: CrossShardTransformation, inputs: OptimizerInputs | None = None
    ) -> tuple[dict[int, TrainStep], dict[int, TrainStep]]:
        """The step functions and the warm-up ones on `tx` (built on `inputs`, if given)."""
        build = functools.partial(
            step_functions, self.task, mesh=self.mesh, spec=self.spec, layout=self.layout
        )
        build = functools.partial(build, precision=self.precision)
        warmup = self.warmup
        if warmup is None:
            return build(tx, inputs=inputs), {}
        warm_inputs = None
        if inputs is not None:
            warm_inputs = inputs._replace(build=lambda values: warmup(inputs.build(values)))
        return build(tx, inputs=inputs), build(warmup(tx), inputs=warm_inputs)

    def inputs(
        self,
        values: Mapping[str, float],
        tx_of: Callable[[Mapping[str, Any]], CrossShardTransformation],
    ) -> StepInputs:
        """The `StepInputs` of `values`, the optimizer built on them by `tx_of`."""
        return StepInputs(values, lambda v: self(tx_of(v), OptimizerInputs(v, tx_of)))


class StepSeat(Protocol):
    """A run's place among others whose steps (and a periodic axis's syncs) run as one
    program (`trainers.core.population.PopulationSeat`)."""

    @property
    def compile_seconds(self) -> float | None:
        """The seconds spent compiling the shared programs so far (None before the first)."""

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The shared compiled step of the lowest level compiled so far (None: none yet)."""

    @property
    def trials(self) -> int:
        """How many runs the shared programs step at once."""

    def expect(self, keys: Iterable[ProgramKey]) -> None:
        """The kinds of step this run will meet (compiled together)."""

    def run(
        self, programs: StepPrograms, key: ProgramKey, state: TrainState, batch: dict[str, Any]
    ) -> tuple[TrainState, StepMetrics]:
        """This run's step of `key`, run with the others'."""

    def sync(self, programs: Any, fragment: int, state: TrainState) -> tuple[TrainState, Any]:
        """This run's sync of `fragment` by its periodic axis's `programs`
        (`trainers.core.periodic.sync.PeriodicPrograms.sync_program`), run with the others':
        its new state and its `xshard.reduce.periodic.SyncStats` vector."""


class StepPrograms:
    """The step programs of a run: one jitted program per `ProgramKey`, lowered from its step
    function, compiled once (`CompiledSteps`), dispatched on global batches.

    Args:
      step_fns: the step function of each level.
      warmup_fns: those of a periodic axis's warm-up steps (the gradient reduced over that
        axis too); empty: none.
      mesh: the device mesh.
      batch_sharding: a global batch's sharding.
      periodic: the periodic axis whose replicas each run the step alone, or None.
      agree_stop: whether the programs take the processes' stop votes.
      grad_impl: ``trainer.grad_impl``, named by the error of an optimizer that needs per-shard
        gradients.
      inputs: the float hyperparameters the programs take as inputs, and the step functions
        built on them (`StepInputs`); None: none, the optimizer's values are constants.
      seat: this run's place in a population of trials whose steps run as one program
        (`trainers.core.population`); None: the run's steps are its own programs.

    Attributes:
      compiled: the compiled programs, with what their tracing recorded.
      compile_seconds: the seconds spent compiling them so far; None before the first.
      hyperparams: the values of `inputs`, placed on every device (what the programs take).
    """

    def __init__(
        self,
        step_fns: Mapping[int, TrainStep],
        warmup_fns: Mapping[int, TrainStep],
        *,
        mesh: Mesh,
        batch_sharding: NamedSharding,
        periodic: Periodic | None,
        agree_stop: bool,
        grad_impl: str,
        inputs: StepInputs | None = None,
        seat: StepSeat | None = None,
    ):
        if seat is not None and agree_stop:
            raise ValueError("a population runs one process's trials (no stop votes)")
        self.seat = seat
        self._fns = {False: dict(step_fns), True: dict(warmup_fns)}
        self.inputs = inputs
        self.mesh, self.batch_sharding, self.periodic = mesh, batch_sharding, periodic
        self.agree_stop, self.grad_impl = agree_stop, grad_impl
        self.compiled = CompiledSteps()
        self.compile_seconds: float | None = None
        # One vote per device, each process filling its own devices (`_votes`).
        self._vote_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        self._vote_arrays: dict[int, jax.Array] = {}
        self._replicated = NamedSharding(mesh, P())
        self.hyperparams = placed_inputs({} if inputs is None else inputs.values, mesh)

    @property
    def has_warmup(self) -> bool:
        """Whether there are warm-up programs (a periodic axis with ``warmup_steps``)."""
        return bool(self._fns[True])

    def lower(self, key: ProgramKey, state: TrainState, batch: dict[str, Any]) -> Traced:
        """Traces and lowers the program of `key` for `state` and batches like `batch` (global
        arrays), without compiling it, with what the tracing recorded.

        Raises:
          ConfigError: for ``grad_impl=gspmd`` with an optimizer that needs per-shard
            gradients.
        """
        shardings = state_shardings(state)
        seen: list[tuple[Any, ...]] = []
        train_step = self.step_program(key, seen)
        extra, extra_shardings = self.extra_inputs(0)
        jitted = jax.jit(
            train_step,
            in_shardings=(shardings, self.batch_sharding, *extra_shardings),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        try:
            with jax.set_mesh(self.mesh):
                lowered = jitted.lower(state, batch, *extra)
        except PerShardGradientsRequired as e:
            raise ConfigError(
                f"trainer.grad_impl={self.grad_impl!r} computes no per-shard gradients, "
                f"but the optimizer needs them: {e} Use trainer.grad_impl=manual, or a reduction "
                "without per-shard clipping or weights (reduction.clip_per_shard=null)."
            ) from None
        names, layouts, stats_keys = seen[0]
        return Traced(lowered, names, layouts, frozenset(stats_keys))

    def step_program(self, key: ProgramKey, seen: list[tuple[Any, ...]]) -> Callable[..., Any]:
        """The traceable program of `key`: ``(state, batch, hyperparams, *votes) -> (state,
        metrics vector)``, every replica alone with a periodic axis; each trace appends to
        `seen` what it recorded: (the metric names, the per-layer statistics' shapes, the
        metrics only statistics steps compute)."""

        def run(state, batch, hyperparams, vote):
            step_fn = self.step_fn(key, hyperparams)
            state, metrics, diag = step_fn.fn(state, batch)
            if vote is not None:  # agree_stop: the highest vote of all devices
                metrics = {**metrics, STOP_VOTE_KEY: vote}
            names, values = stack_metrics(metrics)
            # The per-layer statistics travel in the same vector: one transfer to the host.
            shapes, tail = pack_diagnostics(diag)
            seen.append((names, shapes, step_fn.stats_keys))  # at trace time
            return state, jnp.concatenate([values, tail])

        def train_step(state, batch, hyperparams, *votes):
            vote = jnp.max(votes[0]) if votes else None
            if self.periodic is not None:  # every replica alone: a row of metrics each
                return self.periodic.inner(run, state, batch, hyperparams, vote)
            return run(state, batch, hyperparams, vote)

        return train_step

    def step_fn(self, key: ProgramKey, hyperparams: Mapping[str, Any]) -> TrainStep:
        """The step function of `key`: built on the (traced) `hyperparams` when the programs
        take them as inputs."""
        if self.inputs is None:
            return self._fns[key.warmup][key.level]
        return self.inputs.step_fns(hyperparams)[key.warmup][key.level]

    def compile_missing(
        self, keys: Iterable[ProgramKey], state: TrainState, batch: dict[str, jax.Array]
    ) -> None:
        """Compiles, concurrently, the programs of `keys` not compiled yet, for `state` and
        batches like `batch` (global arrays); their seconds join `compile_seconds`."""
        if self.seat is not None:  # a population compiles its own programs, these with them
            self.seat.expect(keys)
            return
        missing = sorted(key for key in set(keys) if self.compiled.get(key) is None)
        if not missing:
            return
        seconds = self.compiled.compile_concurrently(
            missing, lambda key: self.lower(key, state, batch), tuple(leaf_names(state.params))
        )
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds

    def compile_run(
        self,
        state: TrainState,
        batch: dict[str, jax.Array],
        first: int,
        num_steps: int,
        periods: dict[str, int],
    ) -> None:
        """`compile_missing` of the programs that steps `first` .. `num_steps` will run
        (`keys_in_run` from the `periods` of `step_level`, the periodic axis's warm-up ones
        for its warm-up steps)."""
        periodic = self.periodic
        warmup_steps = periodic.rule.warmup_steps if periodic and self.has_warmup else 0
        self.compile_missing(keys_in_run(first, num_steps, warmup_steps, periods), state, batch)

    def run(
        self, key: ProgramKey, state: TrainState, batch: dict[str, jax.Array], stop_vote: int
    ) -> tuple[TrainState, StepMetrics]:
        """One update by the program of `key` (compiled first if it is not yet), on a global
        `batch`, with this process's `stop_vote`. Donates `state`.

        Raises:
          ValueError: for a warm-up step without warm-up programs.
        """
        if key.warmup and not self.has_warmup:
            raise ValueError("warmup=True needs a periodic axis with warmup_steps > 0.")
        if self.seat is not None:  # one round of the population's program
            state, metrics = self.seat.run(self, key, state, batch)
            self.compile_seconds = self.seat.compile_seconds
            return state, metrics
        self.compile_missing([key], state, batch)
        executable = self.compiled.get(key)
        assert executable is not None
        state, values = executable(state, batch, *self.extra_inputs(stop_vote)[0])
        return state, self.compiled.metrics(key.level, values)

    def extra_inputs(self, stop_vote: int) -> tuple[tuple[Any, ...], tuple[NamedSharding, ...]]:
        """What a step program takes after the state and the batch, and where it lives: the
        hyperparameters and, with `agree_stop`, this process's `stop_vote` on its devices."""
        shardings = (self._replicated,) + ((self._vote_sharding,) if self.agree_stop else ())
        return (self.hyperparams, *self._votes(stop_vote)), shardings

    def _votes(self, vote: int) -> tuple[jax.Array, ...]:
        """The step's vote input: this process's `vote` on each of its devices (cached); none
        without `agree_stop`."""
        if not self.agree_stop:
            return ()
        if vote not in self._vote_arrays:
            self._vote_arrays[vote] = jax.make_array_from_callback(
                (self.mesh.size,), self._vote_sharding, lambda _: np.full((1,), vote, np.int32)
            )
        return (self._vote_arrays[vote],)
