"""Hooks that watch the run: the progress bar and the non-finite guard's limits."""

from __future__ import annotations

import math
import sys
import time

from tqdm import tqdm

from trainers.trainer import Hook, TrainState


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot skip; the run must stop."""


class NonFiniteMonitor(Hook):
    """Stops the run when training goes bad.

    * a non-finite loss while the optimizer does not skip non-finite steps;
    * more than `max_consecutive` skipped (non-finite) steps in a row.

    Raises `NonFiniteError`, so no later checkpoint is written with non-finite values.
    """

    def __init__(self, *, skip_nonfinite: bool, max_consecutive: int):
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive = max_consecutive

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        loss = metrics.get("train/loss", 0.0)
        if not self.skip_nonfinite and not math.isfinite(loss):
            raise NonFiniteError(
                f"Non-finite loss ({loss}) at step {step} and reduction.skip_nonfinite=false: "
                "stopping. Enable reduction.skip_nonfinite=true to skip such steps."
            )
        run = int(metrics.get("train/consecutive_skipped", 0))
        if self.skip_nonfinite and run > self.max_consecutive:
            raise NonFiniteError(
                f"{run} consecutive steps with non-finite gradients (up to step {step}) exceed "
                f"trainer.max_consecutive_nonfinite={self.max_consecutive}: stopping."
            )


class ProgressHook(Hook):
    """A tqdm progress bar on stderr: steps, loss, steps/s."""

    def __init__(self, *, start_step: int, num_steps: int, enabled: bool = True):
        self.bar = tqdm(
            total=num_steps,
            initial=start_step,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not enabled,
            mininterval=0.5,
            dynamic_ncols=True,
        )
        self._last = (start_step, time.perf_counter())

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(step - self.bar.n)
        last_step, last_time = self._last
        now = time.perf_counter()
        if now - last_time >= 1.0:
            self.bar.set_postfix(
                loss=f"{metrics.get('train/loss', float('nan')):.4f}",
                steps_per_s=f"{(step - last_step) / (now - last_time):.1f}",
                refresh=False,
            )
            self._last = (step, now)

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        self.bar.close()
