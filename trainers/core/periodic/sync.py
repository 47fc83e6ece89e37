"""The programs a periodic axis adds to a run's step programs (`trainers.core.periodic.axis`):
one sync program per fragment (and with a ``sync_delay`` one send program per fragment) and
the switch from the warm-up, each compiled when a step first needs it (as the step programs
are: `trainers.core.trainer.Trainer`), then dispatched after the updates that call for it
(`xshard.reduce.periodic.due_fragment`, `due_update`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.metrics import StepMetrics
from trainers.core.periodic.axis import BYTES_TAG, Periodic
from trainers.core.periodic.group_sync import (
    ElasticPrograms,
    ElasticSync,
    Exchange,
    apply_fn,
    delta_program,
    delta_vector,
    heal_program,
)
from trainers.core.periodic.window import WindowParts, window_program
from trainers.core.step.types import TrainState, placed_inputs
from trainers.core.zero import ZeroLayout
from xshard.config.axes import POPULATION_UNSUPPORTED, AxisRule, window_fits
from xshard.errors import ConfigError
from xshard.optim.hyperparams import Hyperparams
from xshard.reduce.periodic import due_fragment, due_update

if TYPE_CHECKING:
    from trainers.core.step.programs import StepSeat

log = logging.getLogger(__name__)


class AfterStep(NamedTuple):
    """What `PeriodicPrograms.after_step` did: the state, the step's metrics (with the sync's
    statistics on a sync step) and the seconds spent compiling (0: nothing compiled)."""

    state: TrainState
    metrics: StepMetrics
    compile_seconds: float


class SyncInputs(NamedTuple):
    """The float hyperparameters the sync programs take as inputs (the outer optimizer's,
    `xshard.optim.hyperparams`): runs that differ only in them share the programs.

    Attributes:
      values: their values for this run (Python numbers), by config key.
      rule: ``values -> AxisRule``: the axis's rule with its outer optimizer built on `values`
        (float32 scalars traced in the program).
    """

    values: Mapping[str, float]
    rule: Callable[[Mapping[str, Any]], AxisRule]


def population_variant(rule: AxisRule) -> str | None:
    """What a periodic axis of `rule` has that a population does not sync
    (`xshard.config.axes.POPULATION_UNSUPPORTED`: fragments, a ``sync_delay``, warm-up steps,
    a codec), as ``field=value``; None: the base case."""
    for name, off in POPULATION_UNSUPPORTED:
        value = getattr(rule, name, off)  # the elastic node is the config's, not the rule's
        if value != off:
            return f"{name}={value!r}"
    return None


def sync_inputs(hyperparams: Hyperparams | None, axis: str) -> SyncInputs | None:
    """The `SyncInputs` of the periodic `axis` from the run's `hyperparams` (None: none)."""
    if hyperparams is None:
        return None
    return SyncInputs(hyperparams.values, lambda values: hyperparams.build(values).axis_rules[axis])


class PeriodicPrograms:
    """The sync and warm-up switch programs of one periodic axis.

    Args:
      periodic: the axis.
      hyperparams: the run's float hyperparameters (`xshard.optim.hyperparams`): its programs
        take the outer optimizer's as inputs (`SyncInputs`); None: constants of its rule.
      seat: the run's place in a population (`trainers.core.step.programs.StepSeat`): its
        syncs run as the population's rounds, vmapped over the trials' stacked states; None:
        its own programs.

    Raises:
      ValueError: with a `seat`, for a rule a population does not sync (`population_variant`).

    Attributes:
      periodic: the axis.
      groups: the parameter leaves of each fragment (set by `prepare`).
      bytes_per_step: bytes a device sends over the axis per step, over a period.
      compile_seconds: the seconds spent compiling its programs so far; None before the first.
      elastic: the sync over replica groups of an elastic axis (`use_exchange`), or None.
    """

    def __init__(
        self,
        periodic: Periodic,
        hyperparams: Hyperparams | None = None,
        seat: StepSeat | None = None,
    ):
        variant = None if seat is None else population_variant(periodic.rule)
        if variant is not None:
            raise ValueError(f"a population syncs a periodic axis without {variant}")
        self.periodic, self.seat = periodic, seat
        self.inputs = inputs = sync_inputs(hyperparams, periodic.axis)
        self._hyperparams = placed_inputs({} if inputs is None else inputs.values, periodic.mesh)
        self.groups: tuple[tuple[int, ...], ...] = ()
        self.bytes_per_step = 0.0
        self._syncs: dict[int, jax.stages.Compiled] = {}
        self._sends: dict[int, jax.stages.Compiled] = {}
        self._windows: dict[int, jax.stages.Compiled] = {}
        self._start: jax.stages.Compiled | None = None
        self.compile_seconds: float | None = None
        self.elastic: ElasticSync | None = None
        self._elastic: ElasticPrograms | None = None

    def use_exchange(self, exchange: Exchange) -> None:
        """Makes the axis elastic: its syncs average over the replica groups reached through
        `exchange` (`trainers.core.periodic.group_sync`).

        Raises:
          ConfigError: if the axis has more than one replica in this group's mesh.
          ValueError: in a population (its syncs are rounds of the trials' stacked states).
        """
        if self.seat is not None:
            raise ValueError("a population syncs a periodic axis without elastic replica groups")
        self.elastic = ElasticSync(self.periodic, exchange)

    def join(self, state: TrainState, shardings: Callable[[TrainState], Any]) -> TrainState:
        """A (re)starting group's first round with its peers (elastic axes only): it sends
        nothing and takes a live peer's state (its step among it) when it is behind them."""
        assert self.elastic is not None, "join: the axis is not elastic"
        return self._elastic_sync(state, shardings, join=True)[0]

    def prepare(self, params: Any) -> None:
        """Splits one replica's `params` into the fragments and measures the bytes sent.

        Raises:
          ValueError: for more fragments than parameter leaves.
        """
        self.groups = self.periodic.groups(params)
        self.bytes_per_step = self.periodic.bytes_per_step(params)

    def replicate(
        self,
        state: TrainState,
        layout: ZeroLayout,
        param_shardings: Callable[[Any], Any],
        opt_state_shardings: Callable[[Any], Any],
    ) -> TrainState:
        """A periodic run's state from one replica's: the replicas (a leading dimension over
        the axis) and the outer state, sharded like the params within a replica (over the
        data axes too with ZeRO stage >= 1). Call it with the mesh in context.

        Raises:
          ConfigError: for a task with model state, or more fragments than leaves.
        """
        periodic = self.periodic
        if jax.tree.leaves(state.model_state):
            raise ConfigError(
                f"reduction.axes.{periodic.axis}: a periodic axis needs a task without model "
                "state (BatchNorm statistics, RNG counters); this task has some."
            )
        base = layout.base_shardings(state.params)
        outer_shardings = layout.sharded(state.params, base) if layout.stage >= 1 else base
        try:
            self.prepare(state.params)
        except ValueError as e:
            raise ConfigError(
                f"reduction.axes.{periodic.axis}.fragments={periodic.rule.fragments}: {e}"
            ) from None
        replica = param_shardings(state.params)
        outer = periodic.init_outer(
            state.params, outer_shardings, base, layout.opt_state_shardings, replica
        )
        params = periodic.stack(state.params, replica)
        opt_state = periodic.stack(state.opt_state, opt_state_shardings(state.params))
        return TrainState(state.step, params, opt_state, state.model_state, outer)

    def sync_executable(self, fragment: int) -> jax.stages.Compiled | None:
        """The compiled sync program of `fragment` (None: not compiled yet)."""
        return self._syncs.get(fragment)

    def after_step(
        self,
        state: TrainState,
        step: int,
        metrics: StepMetrics,
        shardings: Callable[[TrainState], Any],
    ) -> AfterStep:
        """After update `step`: the switch from the warm-up (after step ``warmup_steps``), or
        with a ``sync_delay`` the send of the fragment due (`due_fragment`), and the sync of
        the fragment whose update is due (`due_update`: sent ``sync_delay`` steps before), or
        nothing. Donates `state` when it runs a program; `shardings(state)` gives the state's
        shardings to compile for."""
        periodic = self.periodic
        if step == periodic.rule.warmup_steps:
            seconds = 0.0
            if self._start is None:
                start = lambda s, _: periodic.start(s, self.groups)
                self._start, seconds = self._compile(start, state, shardings(state), False)
            return AfterStep(self._start(state, self._hyperparams), metrics, seconds)
        seconds = 0.0
        sending = due_fragment(step, periodic.rule) if periodic.rule.sync_delay else None
        if sending is not None:  # another fragment than the update's: they commute
            if sending not in self._sends:
                send = lambda s, _: periodic.send(s, sending, self.groups)
                self._sends[sending], seconds = self._compile(send, state, shardings(state), False)
            state = self._sends[sending](state, self._hyperparams)
        fragment = due_update(step, periodic.rule)
        if fragment is None:
            return AfterStep(state, metrics, seconds)
        if self.elastic is not None:
            state, values, more = self._elastic_sync(state, shardings, join=False)
            if values is not None:
                metrics = metrics.with_device_values(periodic.sync_keys(0), values)
            return AfterStep(state, metrics, seconds + more)
        if self.seat is not None:  # a round of the population's sync program
            state, values = self.seat.sync(self, fragment, state)
        else:
            if fragment not in self._syncs:
                sync = self.sync_program(fragment)
                self._syncs[fragment], more = self._compile(sync, state, shardings(state), True)
                seconds += more
            state, values = self._syncs[fragment](state, self._hyperparams)
        metrics = metrics.with_device_values(periodic.sync_keys(fragment), values)
        sent = {BYTES_TAG.format(axis=periodic.axis): self.bytes_per_step}
        return AfterStep(state, metrics.with_host_values(**sent), seconds)

    def compile_elastic(self, state: TrainState, shardings: Callable[[TrainState], Any]) -> float:
        """Compiles an elastic axis's programs for states like `state` (`ElasticPrograms`:
        delta, apply, heal), unless compiled already; returns the seconds it took (0: none).
        Called before the group meets its peers (a warm standby before its go, a group before
        its join round: `trainers.app.elastic_group`), whose next sync would wait for it; the
        axis need not be elastic yet (`use_exchange`). The seconds join `compile_seconds`."""
        if self._elastic is not None:
            return 0.0
        start = time.perf_counter()
        fn = apply_fn(self.groups)
        apply = lambda s, hp, mean: fn(s, self._periodic(hp), mean)
        mesh, target = self.periodic.mesh, shardings(state)
        vector = delta_vector(mesh, state)
        compiled, apply_seconds = self._compile(apply, state, target, True, vector)
        with jax.set_mesh(mesh):
            delta, heal = delta_program(mesh, state, target), heal_program(state, target)
        self._elastic = ElasticPrograms(delta, compiled, heal)
        seconds = time.perf_counter() - start
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds - apply_seconds
        log.info("Compiled the elastic sync's programs (delta, apply, heal) in %.2f s.", seconds)
        return seconds

    def _elastic_sync(
        self, state: TrainState, shardings: Callable[[TrainState], Any], join: bool
    ) -> tuple[TrainState, Any, float]:
        """An elastic axis's sync (`ElasticSync.sync`), its programs compiled if they were not
        (`compile_elastic`): the state, the sync's statistics and the seconds spent compiling."""
        assert self.elastic is not None
        seconds = self.compile_elastic(state, shardings)
        assert self._elastic is not None
        state, values = self.elastic.sync(state, self._hyperparams, shardings, self._elastic, join)
        return state, values, seconds

    def window_executable(self, fragment: int) -> jax.stages.Compiled | None:
        """The compiled window program of `fragment` (None: not compiled yet)."""
        return self._windows.get(fragment)

    def window(
        self, state: TrainState, step: int, batches: tuple[Any, ...], parts: WindowParts
    ) -> tuple[TrainState, jax.Array, jax.Array, float]:
        """Updates ``step + 1 .. step + sync_delay`` on `batches` and the outer update of the
        fragment sent after update `step`, in one program (`trainers.core.periodic.window`).
        Donates `state`. Returns the state, the metrics rows of each update, the sync's
        statistics vector and the seconds spent compiling.

        Raises:
          ValueError: no fragment sent after `step`, a window holding another program of the
            axis (`xshard.config.axes.window_fits`), or not ``sync_delay`` batches.
        """
        rule = self.periodic.rule
        fragment = due_fragment(step, rule)
        if fragment is None or not window_fits(rule) or len(batches) != rule.sync_delay:
            raise ValueError(
                f"no overlapped window after step {step}: fragment {fragment}, "
                f"{len(batches)} batches, sync_delay {rule.sync_delay}, every_steps "
                f"{rule.every_steps}, fragments {rule.fragments}"
            )
        seconds = 0.0
        if fragment not in self._windows:
            program = window_program(parts.step, self.sync_program(fragment), parts.batch_sharding)
            replicated = NamedSharding(self.periodic.mesh, P())
            jitted = jax.jit(
                program,
                in_shardings=(
                    parts.state_shardings,
                    (parts.batch_sharding,) * len(batches),
                    *parts.extra_shardings,
                ),
                out_shardings=(parts.state_shardings, None, replicated),
                donate_argnums=(0,),
            )
            start = time.perf_counter()
            with jax.set_mesh(self.periodic.mesh):
                self._windows[fragment] = jitted.lower(state, batches, *parts.extra).compile()
            seconds = time.perf_counter() - start
            self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        state, values, stats = self._windows[fragment](state, batches, *parts.extra)
        return state, values, stats, seconds

    def sync_program(self, fragment: int) -> Callable[[TrainState, Any], tuple[TrainState, Any]]:
        """The traceable sync of `fragment`: ``(state, hyperparameters) -> (state, its
        `SyncStats` vector)``, the outer optimizer built on the (traced) hyperparameters."""
        return lambda state, hyperparams: self._periodic(hyperparams).sync(
            state, fragment, self.groups
        )

    def _periodic(self, hyperparams: Mapping[str, Any]) -> Periodic:
        """The axis, its rule's outer optimizer built on the (traced) `hyperparams` when the
        programs take them as inputs."""
        if self.inputs is None:
            return self.periodic
        return dataclasses.replace(self.periodic, rule=self.inputs.rule(hyperparams))

    def _compile(
        self,
        fn: Callable,
        state: TrainState,
        shardings: Any,
        with_stats: bool,
        vector: jax.ShapeDtypeStruct | None = None,
    ) -> tuple[jax.stages.Compiled, float]:
        """`fn` ((state, hyperparameters) -> state, or (state, statistics) with `with_stats`)
        compiled for `state`, donating it, and the seconds it took; with `vector` it takes one
        more argument, shaped and placed as that (an elastic sync's mean)."""
        mesh = self.periodic.mesh
        replicated = NamedSharding(mesh, P())
        out = (shardings, replicated) if with_stats else shardings
        vectors = () if vector is None else (vector,)
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = (
                jax.jit(
                    fn,
                    in_shardings=(shardings, replicated, *(v.sharding for v in vectors)),
                    out_shardings=out,
                    donate_argnums=(0,),
                )
                .lower(state, self._hyperparams, *vectors)
                .compile()
            )
        seconds = time.perf_counter() - start
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        return compiled, seconds
