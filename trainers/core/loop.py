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

`FitLoop.run` returns a `FitResult`: what a caller reads of the run, rather than attributes
set on the trainer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax

from trainers.core.hook import Hook, StopTraining, end_hooks
from trainers.core.metrics import COMPILE_TIME, StepMetrics
from trainers.core.periodic.window import overlapped_steps
from trainers.core.step.levels import HISTOGRAMS, LAYERS, STATS, step_level
from trainers.core.step.types import TrainState
from trainers.core.stop_vote import STOP_VOTE_KEY, StopVote
from xshard.reduce.periodic import due_fragment


class Stepper(Protocol):
    """What the loop needs of a `trainers.core.trainer.Trainer`."""

    @property
    def periodic(self) -> Any:
        """The periodic axis (`trainers.core.periodic.axis.Periodic`), or None."""

    @property
    def agree_stop(self) -> bool:
        """Whether the steps take the processes' stop votes."""

    @property
    def compile_seconds(self) -> float | None:
        """The seconds spent compiling the run's programs so far (None: none yet)."""

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

    def compile_run(
        self,
        state: TrainState,
        batch: dict[str, Any],
        first: int,
        num_steps: int,
        periods: dict[str, int],
    ) -> None: ...

    def executables(self) -> dict[int, Any]: ...


@dataclasses.dataclass(frozen=True)
class FitResult:
    """How `Trainer.fit` ended.

    Attributes:
      state: the final state.
      reason: why the loop ended: "done", "data_exhausted", "stopped", or a `StopTraining`'s
        message.
      agreed_stop: with agreed stops (several processes), the vote that stopped the run, or
        None.
      compile_seconds: the trainer's compile seconds so far (`Trainer.compile_seconds`), or
        None if nothing was compiled.
    """

    state: TrainState
    reason: str
    agreed_stop: StopVote | None = None
    compile_seconds: float | None = None


@dataclasses.dataclass
class FitLoop:
    """One `Trainer.fit`: its settings and where it is (`Trainer.fit` documents them).

    Attributes:
      trainer: the trainer whose steps run.
      hooks: receive each step's metrics one step late, diagnostics, states and the end.
      num_steps: the run's total number of updates.
      periods: ``stats_every``, ``layer_stats_every``, ``histogram_every`` (`step_level`).
      compile_ahead: compile every step program the run will meet before its first step
        (`Stepper.compile_run`), else each when a step first needs it.
      should_stop: this process's stop request, polled after every step.
      state: the current state.
      pending: the last dispatched step and its metrics, not yet given to the hooks.
      agreed: with agreed stops, the vote that stops the run once known, else None.
      reported_compile: the compile seconds the last step's metrics reported (`COMPILE_TIME`),
        of this loop or the trainer's previous one (None: none yet): a step after programs
        compiled anew (before the loop too: an elastic group's before it joins its peers)
        reports the new total.
    """

    trainer: Stepper
    hooks: Sequence[Hook]
    num_steps: int
    periods: dict[str, int]
    should_stop: Callable[[], Any]
    state: TrainState
    compile_ahead: bool = True
    pending: tuple[int, StepMetrics] | None = None
    agreed: StopVote | None = None
    reported_compile: float | None = None

    @property
    def agree(self) -> bool:
        """Whether the processes agree on stops within the steps (`Trainer.agree_stop`)."""
        return self.trainer.agree_stop

    def run(self, batches: Iterable[dict[str, Any]]) -> FitResult:
        """Steps until `num_steps`, the data's end or a stop; then every hook's `on_end`.

        Returns:
          The `FitResult`.
        """
        step = int(jax.device_get(self.state.step))
        first = step + 1
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
                elif self.window_due(step):
                    step, reason = self.window(step, batch_iter)
            if self.pending is not None:
                self.emit(self.pending)
        except StopTraining as stop_request:
            reason = str(stop_request) or "stopped"
        except BaseException:
            end_hooks(self.hooks, step, self.state, "error")
            raise
        end_hooks(self.hooks, int(jax.device_get(self.state.step)), self.state, reason)
        return FitResult(self.state, reason, self.agreed, self.trainer.compile_seconds)

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
        metrics = self.with_compile_time(metrics)
        if self.pending is not None:  # waits for step - 1 only: two steps in flight at most
            self.emit(self.pending)
        self.pending = (step, metrics)
        return self.after_update(step, step)

    def after_update(self, first: int, step: int) -> bool:
        """After updates `first` .. `step` (one, or an overlapped window's): whether to stop,
        and the state to the hooks that want it at any of them; returns whether to stop."""
        if self.agree:  # a vote cast at step k - 1 is known now on every process
            stop = self.agreed is not None and step > self.agreed.step
        else:
            stop = self.stop_requested()
        wanted = any(h.wants_state(s) for h in self.hooks for s in range(first, step + 1))
        if self.pending is not None and (stop or wanted):
            self.emit(self.pending)  # the state's own metrics come first
            self.pending = None
            for h in self.hooks:
                h.on_state(step, self.state)
        return stop

    def window_due(self, step: int) -> bool:
        """Whether updates ``step + 1 .. step + sync_delay`` and the delayed sync of the
        fragment sent after `step` run as one overlapped window (the periodic axis's
        ``overlap``), ending within the run."""
        periodic = self.trainer.periodic
        if periodic is None or not periodic.rule.overlap:
            return False
        rule = periodic.rule
        return due_fragment(step, rule) is not None and step + rule.sync_delay <= self.num_steps

    def window(self, step: int, batch_iter: Iterator[dict[str, Any]]) -> tuple[int, str]:
        """The overlapped window after `step` (`trainers.core.periodic.window`): its updates'
        metrics to the hooks in order, lag-one as ever. Returns the last update and why to
        end ("done": go on); where the data ends inside the window, its batches run one by
        one."""
        batches = list(itertools.islice(batch_iter, self.trainer.periodic.rule.sync_delay))
        if len(batches) < self.trainer.periodic.rule.sync_delay:
            for local in batches:
                step += 1
                if self.one_step(step, local):
                    return step, "stopped"
            return step, "data_exhausted"
        vote = self.vote() if self.agree else 0
        self.state, metrics = overlapped_steps(self.trainer, self.state, step, batches, vote)
        metrics[0] = self.with_compile_time(metrics[0])
        first = step + 1
        for m in metrics:
            step += 1
            if self.pending is not None:
                self.emit(self.pending)
            self.pending = (step, m)
        return step, "stopped" if self.after_update(first, step) else "done"

    def with_compile_time(self, metrics: StepMetrics) -> StepMetrics:
        """`metrics` with `COMPILE_TIME` (the run's compile seconds so far) if programs were
        compiled since the last step that reported it: once per compiling step."""
        seconds = self.trainer.compile_seconds
        if seconds is None or seconds == self.reported_compile:
            return metrics
        self.reported_compile = seconds
        return metrics.with_host_values(**{COMPILE_TIME: seconds})

    def stop_requested(self) -> bool:
        """This process's stop request: `should_stop` or a hook's `wants_stop`."""
        return bool(self.should_stop()) or any(h.wants_stop() for h in self.hooks)

    def vote(self) -> int:
        """This process's `StopVote`, encoded for the step."""
        hook = any(h.wants_stop() for h in self.hooks)
        return StopVote.encode(jax.process_index(), bool(self.should_stop()), hook)

    def emit(self, pending: tuple[int, StepMetrics]) -> None:
        """A step's metrics (and diagnostics) to the hooks; with agreed stops, the vote they
        carry, once it says stop, to `agreed` and every hook's `on_stop_agreed`."""
        step, metrics = pending
        host = metrics.host_values()  # waits for this step only
        for h in self.hooks:
            h.on_step(step, host)
        diag = metrics.diagnostics  # None except on the steps that log them
        if diag is not None:
            for h in self.hooks:
                h.on_diagnostics(step, diag)
        if self.agree and self.agreed is None:
            self.agreed = StopVote.decode(step, metrics.device_value(STOP_VOTE_KEY))
            if self.agreed is not None:
                for h in self.hooks:
                    h.on_stop_agreed(self.agreed)
