"""The moving-average gradient noise scale (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", App. A).

Single-step estimates of B_simple = tr(Sigma) / |G|^2 are noisy (|G|^2's estimate can even be
negative), so the paper averages the two terms separately and takes the ratio of the averages.
`NoiseScaleEMA` does that on every step that computed the statistics (``grad/noise_trace`` and
``grad/noise_grad_sq``, every ``trainer.stats_every`` steps). Its decay is expressed in
training steps, not in updates: an update `delta` steps after the previous one weighs the past
by ``exp(-delta / steps)``, so the time constant stays ``logger.noise_ema_steps`` whatever
``trainer.stats_every`` is. Both averages start from zero with the same weights, so their
ratio needs no bias correction.
"""

from __future__ import annotations

import math


class NoiseScaleEMA:
    """Ratio of exponential moving averages of tr(Sigma) and |G|^2 estimates.

    Args:
      steps: the averaging time constant in training steps (> 0).

    Raises:
      ValueError: for `steps` <= 0.
    """

    def __init__(self, steps: float):
        if not steps > 0:
            raise ValueError(f"steps={steps!r}: expected a number of steps > 0.")
        self.steps = float(steps)
        self.trace = 0.0
        self.grad_sq = 0.0
        self.last_step: int | None = None

    def update(self, step: int, trace: float, grad_sq: float) -> None:
        """Folds in the estimates of step `step` (non-finite ones are ignored)."""
        if not (math.isfinite(trace) and math.isfinite(grad_sq)):
            return
        delta = 1 if self.last_step is None else max(step - self.last_step, 1)
        decay = math.exp(-delta / self.steps)
        self.trace = decay * self.trace + (1 - decay) * trace
        self.grad_sq = decay * self.grad_sq + (1 - decay) * grad_sq
        self.last_step = step

    @property
    def value(self) -> float | None:
        """B_simple from the averages; None before any update or while |G|^2's is <= 0."""
        if self.last_step is None or self.grad_sq <= 0:
            return None
        return self.trace / self.grad_sq
