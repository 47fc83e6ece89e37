"""TensorBoard logging for a run: scalars, diagnostics, the resolved config and an hparams entry.

One `tensorboardX.SummaryWriter` per run, at `<output dir>/tb`. The hparams summary is written
into that same writer (tensorboardX's `add_hparams` would open a second one in a subfolder),
so a multirun sweep shows one run per job in both the Scalars and the HParams dashboards.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summary

from trainers.trainer import Hook, TrainState

FINAL_LOSS_TAG = "hparams/final_loss"


class TensorBoardHook(Hook):
    """Writes every `log_every`-th step's metrics (and all diagnostics) to `logdir`.

    Args:
      logdir: the run's TensorBoard directory.
      log_every: scalar logging period in steps (the last step is always logged).
      global_batch_size: for `perf/examples_per_sec`.
      hparams: flat dict of hyperparameters (Hydra choices and key values) for HParams.
      config_yaml: the resolved config, shown in the Text dashboard.
      num_steps: the run's total steps (to log the last one).
      flush_secs: how often the writer flushes to disk.
    """

    def __init__(
        self,
        logdir: str,
        *,
        log_every: int,
        global_batch_size: int,
        num_steps: int,
        hparams: dict[str, Any] | None = None,
        config_yaml: str | None = None,
        flush_secs: int = 10,
    ):
        self.writer = SummaryWriter(logdir=logdir, flush_secs=flush_secs)
        self.log_every = max(1, int(log_every))
        self.global_batch_size = global_batch_size
        self.num_steps = num_steps
        self.last_loss: float | None = None
        self._window_start: tuple[int, float] | None = None
        self._noise_ema: list[float] | None = None  # [tr(Sigma), |G|^2], every step
        self._clip_fired: list[float] = []  # grad/clip_fired of the steps since the last write
        if config_yaml is not None:
            # Indented lines render as a code block in TensorBoard's markdown.
            self.writer.add_text(
                "config", "\n".join("    " + line for line in config_yaml.splitlines()), 0
            )
        if hparams:
            exp, ssi, _ = hparams_summary(_hparam_values(hparams), {FINAL_LOSS_TAG: 0.0})
            self.writer.file_writer.add_summary(exp)
            self.writer.file_writer.add_summary(ssi)
        self._hparams = hparams

    def log_scalar(self, tag: str, value: float, step: int) -> None:
        """Writes one scalar (e.g. `perf/compile_time_s`)."""
        self.writer.add_scalar(tag, value, step)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_loss = metrics.get("train/loss", self.last_loss)
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start = (step, now)  # the first step includes compilation
        self._update_noise_ema(metrics)
        if "grad/clip_fired" in metrics:
            self._clip_fired.append(metrics["grad/clip_fired"])
        if "perf/compile_time_s" in metrics:
            self.writer.add_scalar("perf/compile_time_s", metrics["perf/compile_time_s"], step)
        if step % self.log_every and step != self.num_steps:
            return
        for tag, value in metrics.items():
            if tag == "grad/noise_scale" and not math.isfinite(value):
                continue  # undefined on steps where the |G|^2 estimate is <= 0
            self.writer.add_scalar(tag, value, step)
        if self._clip_fired:  # how often the global clip fired since the last write
            rate = sum(self._clip_fired) / len(self._clip_fired)
            self.writer.add_scalar("grad/clip_fired_rate", rate, step)
            self._clip_fired = []
        if self._noise_ema is not None and self._noise_ema[1] > 0:
            self.writer.add_scalar(
                "grad/noise_scale_ema", self._noise_ema[0] / self._noise_ema[1], step
            )
        start_step, start_time = self._window_start
        if step > start_step and now > start_time:
            rate = (step - start_step) / (now - start_time)
            self.writer.add_scalar("perf/steps_per_sec", rate, step)
            self.writer.add_scalar("perf/examples_per_sec", rate * self.global_batch_size, step)
        self._window_start = (step, now)

    def _update_noise_ema(self, metrics: dict[str, float], decay: float = 0.95) -> None:
        """B_simple from moving averages of its two noisy terms (McCandlish et al., App. A)."""
        if "grad/noise_trace" not in metrics:
            return
        new = [metrics["grad/noise_trace"], metrics["grad/noise_grad_sq"]]
        if not all(map(math.isfinite, new)):
            return
        if self._noise_ema is None:
            self._noise_ema = new
        else:
            self._noise_ema = [decay * e + (1 - decay) * x for e, x in zip(self._noise_ema, new)]

    def on_diagnostics(self, step: int, diag: dict[str, Any]) -> None:
        for name, value in diag.get("grad_norms", {}).items():
            self.writer.add_scalar(f"layers/grad_norm/{name}", float(value), step)
        for name, value in diag.get("param_norms", {}).items():
            self.writer.add_scalar(f"layers/param_norm/{name}", float(value), step)
        for name, h in diag.get("grad_hist", {}).items():
            if float(h["num"]) > 0:
                self.writer.add_histogram_raw(
                    f"grad_hist/{name}",
                    min=float(h["min"]),
                    max=float(h["max"]),
                    num=float(h["num"]),
                    sum=float(h["sum"]),
                    sum_squares=float(h["sum_squares"]),
                    bucket_limits=[float(x) for x in h["bucket_limits"]],
                    bucket_counts=[float(x) for x in h["bucket_counts"]],
                    global_step=step,
                )

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        if self.last_loss is not None:
            self.writer.add_scalar(FINAL_LOSS_TAG, self.last_loss, step)
        if self._hparams:
            _, _, sei = hparams_summary(_hparam_values(self._hparams), {FINAL_LOSS_TAG: 0.0})
            self.writer.file_writer.add_summary(sei)
        self.close()

    def close(self) -> None:
        """Flushes and closes the writer (idempotent)."""
        self.writer.flush()
        self.writer.close()


def _hparam_values(hparams: dict[str, Any]) -> dict[str, bool | str | float | int]:
    """HParams accepts bool/str/int/float only: everything else is shown as a string."""
    return {k: v if isinstance(v, (bool, str, int, float)) else str(v) for k, v in hparams.items()}
