"""The loop of `Trainer.fit`: steps, lag-one metrics, hooks, stops.

It keeps at most two steps in flight: it dispatches step k, then waits for the metrics of step
k-1. That bounds the work queued on the devices (XLA:CPU collectives deadlock with dozens of
steps in flight, see docs/development.md), gives lag-one logging without stalls, and lets
every step's loss be checked on the host.

A stop request (a signal, a hook's `wants_stop`) is local to one process. With several
processes each one casts a vote into the step it dispatches; the step reduces the votes over
all devices and returns the result with its metrics (`STOP_VOTE_KEY`), which the loop fetches
anyway. Every process so learns of a stop voted at step k from the same metrics and ends after
step k + 1: no host synchronisation beyond the existing metrics fetch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import jax

from trainers.core.hook import Hook, StopTraining, end_hooks
from trainers.core.metrics import StepMetrics
from trainers.core.step import HISTOGRAMS, LAYERS, STATS, TrainState
from trainers.core.step_levels import step_level
from trainers.core.stop_vote import STOP_VOTE_KEY, StopVote


class Stepper(Protocol):
    """What the loop needs of a `trainers.core.trainer.Trainer`."""

    periodic: Any  # a `trainers.core.periodic.Periodic`, or None
    agree_stop: bool
    agreed_stop: StopVote | None

    def step(
        self,
        state: TrainState,
        batch: dict[str, Any],
        *,
        with_stats: bool = True,
        layer_stats: bool = False,
        histograms: bool = False,
        stop_vote: int = 0,
        warmup: bool = False,
    ) -> tuple[TrainState, StepMetrics]: ...

    def sync(
        self, state: TrainState, step: int, metrics: StepMetrics
    ) -> tuple[TrainState, StepMetrics]: ...

    def with_compile_time(self, metrics: StepMetrics) -> StepMetrics: ...

    def compile_run(
        self,
        state: TrainState,
        batch: dict[str, Any],
        first: int,
        num_steps: int,
        periods: dict[str, int],
    ) -> None: ...

    def executables(self) -> dict[int, Any]: ...


@dataclasses.dataclass
class FitLoop:
    """One `Trainer.fit`: its settings and where it is (`Trainer.fit` documents them).

    Attributes:
      trainer: the trainer whose steps run (its ``agreed_stop`` is kept up to date).
      hooks: receive each step's metrics one step late, diagnostics, states and the end.
      num_steps: the run's total number of updates.
      periods: ``stats_every``, ``layer_stats_every``, ``histogram_every`` (`step_level`).
      compile_ahead: compile every step program the run will meet before its first step
        (`Stepper.compile_run`), else each when a step first needs it.
      should_stop: this process's stop request, polled after every step.
      state: the current state.
      pending: the last dispatched step and its metrics, not yet given to the hooks.
    """

    trainer: Stepper
    hooks: Sequence[Hook]
    num_steps: int
    periods: dict[str, int]
    should_stop: Callable[[], Any]
    state: TrainState
    compile_ahead: bool = True
    pending: tuple[int, StepMetrics] | None = None

    @property
    def agree(self) -> bool:
        """Whether the processes agree on stops within the steps (`Trainer.agree_stop`)."""
        return self.trainer.agree_stop

    def run(self, batches: Iterable[dict[str, Any]]) -> tuple[TrainState, str]:
        """Steps until `num_steps`, the data's end or a stop; then every hook's `on_end`.

        Returns:
          (final state, reason the loop ended).
        """
        step = int(jax.device_get(self.state.step))
        first = step + 1
        self.trainer.agreed_stop = None
        reason = "done"
        try:
            if not self.agree and self.stop_requested():  # e.g. a signal during start-up
                reason = "stopped"
            batch_iter = iter(batches)
            while reason == "done" and step < self.num_steps:
                local = next(batch_iter, None)
                if local is None:
                    reason = "data_exhausted"
                    break
                step += 1
                if self.compile_ahead and step == first:
                    self.trainer.compile_run(self.state, local, step, self.num_steps, self.periods)
                    for hook in self.hooks:
                        hook.on_compiled(self.trainer.executables())
                if self.one_step(step, local):
                    reason = "stopped"
            if self.pending is not None:
                self.emit(self.pending)
        except StopTraining as stop_request:
            reason = str(stop_request) or "stopped"
        except BaseException:
            end_hooks(self.hooks, step, self.state, "error")
            raise
        end_hooks(self.hooks, int(jax.device_get(self.state.step)), self.state, reason)
        return self.state, reason

    def one_step(self, step: int, local: dict[str, Any]) -> bool:
        """Update `step` (and its sync), the previous step's metrics to the hooks, the state
        to those that want it; returns whether to stop after it."""
        trainer = self.trainer
        level = step_level(step, self.num_steps, **self.periods)
        periodic = trainer.periodic
        self.state, metrics = trainer.step(
            self.state,
            local,
            with_stats=level >= STATS,
            layer_stats=level >= LAYERS,
            histograms=level >= HISTOGRAMS,
            stop_vote=self.vote() if self.agree else 0,
            warmup=periodic is not None and periodic.in_warmup(step),
        )
        self.state, metrics = trainer.sync(self.state, step, metrics)
        metrics = trainer.with_compile_time(metrics)
        if self.pending is not None:  # waits for step - 1 only: two steps in flight at most
            self.emit(self.pending)
        self.pending = (step, metrics)
        if self.agree:  # a vote cast at step k - 1 is known now on every process
            agreed = trainer.agreed_stop
            stop = agreed is not None and step > agreed.step
        else:
            stop = self.stop_requested()
        if stop or any(h.wants_state(step) for h in self.hooks):
            self.emit(self.pending)  # the state's own metrics come first
            self.pending = None
            for h in self.hooks:
                h.on_state(step, self.state)
        return stop

    def stop_requested(self) -> bool:
        """This process's stop request: `should_stop` or a hook's `wants_stop`."""
        return bool(self.should_stop()) or any(h.wants_stop() for h in self.hooks)

    def vote(self) -> int:
        """This process's `StopVote`, encoded for the step."""
        hook = any(h.wants_stop() for h in self.hooks)
        return StopVote.encode(jax.process_index(), bool(self.should_stop()), hook)

    def emit(self, pending: tuple[int, StepMetrics]) -> None:
        """A step's metrics (and diagnostics) to the hooks; with agreed stops, the vote they
        carry to the trainer's ``agreed_stop``."""
        step, metrics = pending
        host = metrics.host_values()  # waits for this step only
        for h in self.hooks:
            h.on_step(step, host)
        diag = metrics.diagnostics  # None except on the steps that log them
        if diag is not None:
            for h in self.hooks:
                h.on_diagnostics(step, diag)
        if self.agree and self.trainer.agreed_stop is None:
            self.trainer.agreed_stop = StopVote.decode(step, metrics.device_value(STOP_VOTE_KEY))
