"""Speed of the compiled step: FLOPs from XLA's cost analysis, and `jax.profiler` traces.

``perf/flops_per_sec`` is XLA's count of the compiled step's floating-point operations
(`step_flops`, per device: the cost analysis is of the partitioned per-device program) times
the steps per second and the device count. It counts everything the step computes (forward,
backward, optimizer, statistics; both branches of a ``lax.cond`` as XLA counts them), so it is
an estimate a little above the model's FLOPs. ``perf/mfu`` divides the per-device rate by
``logger.peak_flops_per_device`` (e.g. 1.97e14 for a TPU v5e chip in bf16); it is left out
when that is null, as on CPU, where no peak is meaningful.

A trial of a population (``hydra/launcher=population``, `trainers.core.population`) has no
step program of its own: its FLOPs per step are its share of the population's step, XLA's
count of the population's program divided by its trials (`run_step_flops`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainers.core.trainer import Hook, Trainer, TrainState

logger = logging.getLogger(__name__)


def step_flops(compiled: Any) -> float | None:
    """FLOPs of one run of `compiled` on one device, from XLA's cost analysis; None if unknown.

    Args:
      compiled: a `jax.stages.Compiled` (``Trainer.compiled``), or None.
    """
    if compiled is None:
        return None
    try:
        costs = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(costs, list | tuple):  # older JAX: one dict per device program
        costs = costs[0] if costs else None
    flops = (costs or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def run_step_flops(trainer: Trainer) -> float | None:
    """FLOPs of one of `trainer`'s steps on one device (None if unknown): `step_flops` of its
    compiled step or, in a population, of the population's divided by its trials (each
    trial's share of the program that steps them all)."""
    seat = trainer.programs.seat
    if seat is None:
        return step_flops(trainer.compiled)
    flops = step_flops(seat.compiled)
    return None if flops is None else flops / seat.trials


class ProfileHook(Hook):
    """Writes a `jax.profiler` trace of steps ``[first, last]`` into `log_dir`.

    TensorBoard's Profile tab (``tensorboard-plugin-profile``) reads it from
    ``<log_dir>/plugins/profile/<session>/``; with `log_dir` the run's TensorBoard dir it
    appears under the run's name. Metrics reach hooks one step late, so the trace starts when
    step ``first - 2``'s metrics arrive (step ``first - 1`` is then running; at the start of
    training for ``first`` <= 2) and stops when step `last`'s arrive: it covers the steps
    asked for, plus at most one step on either side.

    Args:
      log_dir: where the trace goes.
      first, last: the steps to trace (1 <= first <= last).
      start_step: the step the run starts from (a trace of steps before it is skipped).
    """

    def __init__(self, log_dir: str, first: int, last: int, *, start_step: int = 0):
        self.log_dir = str(log_dir)
        self.first, self.last = first, last
        self.active = False
        self.done = last <= start_step
        if not self.done and first - 2 <= start_step:
            self._start()

    def _start(self) -> None:
        import jax

        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(self.log_dir)
        self.active = True
        logger.info("Profiling steps %d-%d into %s.", self.first, self.last, self.log_dir)

    def _stop(self) -> None:
        import jax

        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.done = True
            logger.info(
                "Profile written to %s/plugins/profile (TensorBoard's Profile tab).",
                self.log_dir,
            )

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if self.done:
            return
        if not self.active and step >= self.first - 2:
            self._start()
        if self.active and step >= self.last:
            self._stop()

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        self._stop()
