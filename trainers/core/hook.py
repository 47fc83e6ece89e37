"""The hooks `Trainer.fit` calls: the `Hook` base class, `StopTraining`, and `end_hooks`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from trainers.core.step.types import TrainState
from trainers.core.stop_vote import StopVote

logger = logging.getLogger("trainers.core.trainer")


class Hook:
    """Receives host-side values from `Trainer.fit`; override what you need.

    Any hook may raise `StopTraining` to end the run cleanly, or another exception to abort it
    (then every hook's `on_end` sees reason "error"). A hook that can no longer do its job but
    should let the run save its state first (a dead TensorBoard writer) returns True from
    `wants_stop`: the run then ends like on a stop signal, with reason "stopped".
    """

    def on_compiled(self, programs: Mapping[int, Any]) -> None:
        """The step programs the run compiled before its first step (``fit(compile_ahead=
        True)``), by level (`jax.stages.Compiled`: their memory and cost analyses), before any
        of them runs. Raise to refuse the run before it trains."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics of step `step` (1-based count of updates), delivered one step late."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's metrics (``{"eval/loss": ..., ...}``) of the params after step
        `step`: every ``trainer.eval_every`` steps and at the end of the run. Comes from the
        evaluation hook's `on_state` (or its `on_end`, for the final one), after `on_step` of
        that step."""

    def on_diagnostics(self, step: int, diag: dict[str, Any]) -> None:
        """Per-parameter norms / gradient histograms of step `step`, right after its metrics:
        the norms of the gradient that step applied and of the params after it
        (`StepMetrics.diagnostics`)."""

    def wants_state(self, step: int) -> bool:
        """Whether `on_state` should see the state right after step `step`."""
        return False

    def on_state(self, step: int, state: TrainState) -> None:
        """The state after step `step`, whose metrics every hook has already seen."""

    def wants_stop(self) -> bool:
        """Whether the run should end cleanly after the current step (polled like a signal)."""
        return False

    def on_stop_agreed(self, vote: StopVote) -> None:
        """With stops agreed between processes (``Trainer(agree_stop=...)``): the vote that
        ends the run after the next step (whose process, whether a signal or a hook cast it),
        as soon as this process knows it, before that step's `on_state` and the `on_end`."""

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        """Once, when the loop ends: "done", "data_exhausted", "stopped" (a stop signal, a
        hook's `wants_stop`; a `StopTraining` gives its message, "stopped" by default) or
        "error"."""


class StopTraining(Exception):
    """Raised by a hook or the stop flag to end `fit` cleanly after the current step."""


def end_hooks(hooks: Sequence[Hook], step: int, state: TrainState, reason: str) -> None:
    """Every hook's `on_end`, even when one of them raises (a later hook may save a checkpoint).

    Raises:
      The first error of an `on_end`, after all ran; later ones are logged in one line each.
      On reason "error" (the run is failing already) they are only logged, so that the run's
      own error is the one raised.
    """
    first: Exception | None = None
    for h in hooks:
        try:
            h.on_end(step, state, reason)
        except Exception as e:  # each hook must get its on_end
            if first is None and reason != "error":
                first = e
            else:
                logger.error("%s.on_end(%r) failed too: %s", type(h).__name__, reason, e)
    if first is not None:
        raise first
