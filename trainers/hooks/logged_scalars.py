"""The scalars a logger writes for a step: the step's metrics plus what is derived from them.

Every logger (TensorBoard, W&B, MLflow, CSV: ``logger=...``) writes the same scalars, built here
once for all of them (`trainers.hooks.run_logger.LoggerHook`) from the metrics `Trainer.fit`
hands to hooks: on every ``log_every``-th step and the last one, each metric (less an undefined
``grad/noise_scale``), the clip rate since the last write (``grad/clip_fired_rate``),
``grad/noise_scale_ema`` (`trainers.hooks.noise_ema`), and the throughput since the last write
(``perf/steps_per_sec``, ``examples_per_sec``, ``tokens_per_sec``, ``flops_per_sec``, ``mfu``:
`trainers.hooks.perf`); on the step that compiled, ``perf/compile_time_s`` (the run's compile
time so far), and on a periodic axis's sync step its ``sync/<axis>/*`` and
``comm/<axis>/bytes_per_step`` (`on_its_step`, whatever ``log_every`` says: a sync is rarer
than most logging periods, and each one matters); with every write, the
``comm/<axis>/bytes_per_step`` of the axes the reduction's mode reduces every step (constant:
the synchronous baseline; an axis with an every-step rule logs its own from the step).
Programs compile when a step first needs them (`trainers.core.trainer.Trainer`): the
throughput leaves the compile time inside its window out, so that it measures steps, not
compilation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping

from trainers.core.metrics import COMPILE_TIME
from trainers.core.periodic import BYTES_TAG, is_sync_tag
from trainers.hooks.noise_ema import NoiseScaleEMA

Scalars = list[tuple[str, float]]


@dataclasses.dataclass(frozen=True)
class ScalarOptions:
    """What the logged scalars are derived with (`LoggedScalars`).

    Attributes:
      log_every: logging period in steps (the last step is always logged).
      num_steps: the run's total steps.
      global_batch_size: for ``perf/examples_per_sec``.
      noise_ema_steps: time constant of ``grad/noise_scale_ema`` in steps.
      tokens_per_example: the task's tokens per example, for ``perf/tokens_per_sec``.
      num_devices: devices running the step.
      peak_flops_per_device: for ``perf/mfu``; None leaves MFU out.
      step_flops: returns the compiled step's FLOPs per device, or None when unknown
        (`trainers.hooks.perf.step_flops`).
      compile_seconds: returns the run's compile time so far (`Trainer.compile_seconds`),
        read at each write: the throughput leaves what compiled within its window out.
      periodic_axis: the reduction's periodic axis, whose sync statistics are logged on their
        own steps; None without one.
      traffic: ``comm/<axis>/bytes_per_step`` of each axis the reduction's mode reduces every
        step (`xshard.optim.cross_shard.CrossShardSpec.mode_bytes_per_step`), constant over the
        run and written with every write: the synchronous baseline a periodic axis's own
        ``comm/<axis>/bytes_per_step`` compares with.
    """

    log_every: int
    num_steps: int
    global_batch_size: int
    noise_ema_steps: float = 50
    tokens_per_example: int | None = None
    num_devices: int = 1
    peak_flops_per_device: float | None = None
    step_flops: Callable[[], float | None] | None = None
    compile_seconds: Callable[[], float | None] | None = None
    periodic_axis: str | None = None
    traffic: Mapping[str, float] = dataclasses.field(default_factory=dict)


class LoggedScalars:
    """Turns each step's metrics into the scalars to log (module docstring).

    Args:
      options: the logging period, the run's size and what the throughput is derived with.
    """

    def __init__(self, options: ScalarOptions):
        self.options = options
        self.log_every = max(1, int(options.log_every))
        self.noise_ema = NoiseScaleEMA(options.noise_ema_steps)
        self._flops: float | None = None
        self._window_start: tuple[int, float] | None = None
        self._clip_fired: list[float] = []  # grad/clip_fired of the steps since the last write
        self._compiled_at_start = 0.0  # the run's compile time when the window started

    def on_its_step(self, metrics: dict[str, float]) -> Scalars:
        """The scalars logged on the step that has them, whatever the period:
        ``perf/compile_time_s`` of a step that compiled, a sync step's statistics."""
        return [(tag, value) for tag, value in metrics.items() if self._on_its_step(tag)]

    def __call__(self, step: int, metrics: dict[str, float]) -> Scalars | None:
        """The scalars of a logging step; None on the other steps (whose metrics still feed
        the moving averages)."""
        if self._window_start is None:
            self._window_start = (step, time.perf_counter())  # the first step: compilation
            self._compiled_at_start = self._compiled()
        if "grad/noise_trace" in metrics:  # every statistics step, logged or not
            self.noise_ema.update(step, metrics["grad/noise_trace"], metrics["grad/noise_grad_sq"])
        if "grad/clip_fired" in metrics:
            self._clip_fired.append(metrics["grad/clip_fired"])
        if step % self.log_every and step != self.options.num_steps:
            return None
        now = time.perf_counter()
        scalars = [
            (tag, value)
            for tag, value in metrics.items()
            # undefined on steps where the |G|^2 estimate is <= 0
            if (tag != "grad/noise_scale" or math.isfinite(value)) and not self._on_its_step(tag)
        ]  # `on_its_step` logs those on every step that has them
        scalars += [
            (BYTES_TAG.format(axis=axis), float(b)) for axis, b in self.options.traffic.items()
        ]
        if self._clip_fired:  # how often the global clip fired since the last write
            scalars.append(("grad/clip_fired_rate", sum(self._clip_fired) / len(self._clip_fired)))
            self._clip_fired = []
        if self.noise_ema.value is not None:
            scalars.append(("grad/noise_scale_ema", self.noise_ema.value))
        start_step, start_time = self._window_start
        compiled = self._compiled()
        elapsed = now - start_time - (compiled - self._compiled_at_start)
        if step > start_step and elapsed > 0:
            scalars += self._speed((step - start_step) / elapsed)
        self._window_start = (step, now)
        self._compiled_at_start = compiled
        return scalars

    def _compiled(self) -> float:
        """The run's compile time so far (0 when unknown)."""
        compile_seconds = self.options.compile_seconds
        return (compile_seconds() if compile_seconds else None) or 0.0

    def _speed(self, steps_per_sec: float) -> Scalars:
        """Steps, examples (tokens) and FLOPs per second, and MFU when the peak is known."""
        opts = self.options
        examples = steps_per_sec * opts.global_batch_size
        out = [("perf/steps_per_sec", steps_per_sec), ("perf/examples_per_sec", examples)]
        if opts.tokens_per_example:
            out.append(("perf/tokens_per_sec", examples * opts.tokens_per_example))
        if self._flops is None and opts.step_flops is not None:
            self._flops = opts.step_flops()
        if self._flops:
            per_device = self._flops * steps_per_sec
            out.append(("perf/flops_per_sec", per_device * opts.num_devices))
            if opts.peak_flops_per_device:
                out.append(("perf/mfu", per_device / opts.peak_flops_per_device))
        return out

    def _on_its_step(self, tag: str) -> bool:
        """Whether `tag` is logged on every step that has it (`on_its_step`)."""
        axis = self.options.periodic_axis
        return tag == COMPILE_TIME or (axis is not None and is_sync_tag(tag, axis))
