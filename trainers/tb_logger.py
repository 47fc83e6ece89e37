"""TensorBoard logging for a run: scalars, diagnostics, the resolved config and an hparams entry.

One `tensorboardX.SummaryWriter` per run, at `<output dir>/tb`. The hparams summary is written
into that same writer (tensorboardX's `add_hparams` would open a second one in a subfolder),
so a multirun sweep shows one run per job in both the Scalars and the HParams dashboards.

Events are written through `SafeSummaryWriter`: when writing fails (disk full), the run never
hangs. With ``logger.on_error=stop`` (the default) it stops cleanly after the current step,
saves its checkpoint and `train.py` exits 2 with `LoggerError`; with ``continue`` it warns once
and trains on without events.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from tensorboardX.summary import hparams as hparams_summary

from trainers.tb_writer import SafeSummaryWriter
from trainers.trainer import Hook, TrainState
from xshard.config.outputs import ON_ERROR

logger = logging.getLogger(__name__)

FINAL_LOSS_TAG = "hparams/final_loss"


class LoggerError(Exception):
    """TensorBoard events could not be written and ``logger.on_error=stop``."""


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
      on_error: "stop" or "continue" when events cannot be written (`LoggerOptions`).

    Raises:
      ValueError: for an `on_error` other than "stop" or "continue".
      LoggerError: from the constructor or `on_end`, if writing failed and `on_error` is
        "stop" (the run has stopped cleanly by then: `wants_stop`).
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
        flush_secs: float = 10,
        on_error: str = "stop",
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {list(ON_ERROR)}.")
        self.logdir = logdir
        self.on_error = on_error
        self._reported = False
        self.writer = SafeSummaryWriter(logdir, flush_secs=flush_secs)
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
            self.writer.add_summary(exp)
            self.writer.add_summary(ssi)
        self._hparams = hparams
        self._check()
        if self.writer.failure is not None and on_error == "stop":
            self.writer.close()
            raise LoggerError(self._error_message("before training"))

    def log_scalar(self, tag: str, value: float, step: int) -> None:
        """Writes one scalar (e.g. `perf/compile_time_s`)."""
        self.writer.add_scalar(tag, value, step)

    def wants_stop(self) -> bool:
        return self.on_error == "stop" and self.writer.failure is not None

    def _check(self) -> None:
        """Reports a failed writer once: the run stops, or goes on without events."""
        if self.writer.failure is None or self._reported:
            return
        self._reported = True
        if self.on_error == "continue":
            logger.warning(
                "TensorBoard events cannot be written to %s (%s): training continues without "
                "them (logger.on_error=continue).",
                self.logdir,
                self.writer.failure,
            )
        else:
            logger.error(
                "TensorBoard events cannot be written to %s (%s): stopping after this step "
                "(logger.on_error=stop).",
                self.logdir,
                self.writer.failure,
            )

    def _error_message(self, when: str) -> str:
        return (
            f"TensorBoard events cannot be written to paths.tb_dir={self.logdir!r}: "
            f"{self.writer.failure}. The run stopped cleanly {when} (logger.on_error=stop). "
            "Free space there and rerun the same command to resume, or set "
            "logger.on_error=continue to train without events."
        )

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
        self._check()

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
        self._check()

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        if self.last_loss is not None:
            self.writer.add_scalar(FINAL_LOSS_TAG, self.last_loss, step)
        if self._hparams:
            _, _, sei = hparams_summary(_hparam_values(self._hparams), {FINAL_LOSS_TAG: 0.0})
            self.writer.add_summary(sei)
        self.close()
        self._check()
        if self.writer.failure is not None and self.on_error == "stop" and reason != "error":
            raise LoggerError(self._error_message(f"at step {step}"))

    def close(self) -> None:
        """Flushes and closes the writer (idempotent; never raises for a failed write)."""
        self.writer.flush()
        self.writer.close()


def _hparam_values(hparams: dict[str, Any]) -> dict[str, bool | str | float | int]:
    """HParams accepts bool/str/int/float only: everything else is shown as a string."""
    return {k: v if isinstance(v, (bool, str, int, float)) else str(v) for k, v in hparams.items()}
