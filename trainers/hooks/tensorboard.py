"""TensorBoard logging for a run: scalars, diagnostics, the resolved config and an hparams entry.

One `tensorboardX.SummaryWriter` per run, at ``paths.tb_dir`` (a folder named by the run's
overrides). The hparams summary (`trainers.hooks.hparams`) is written into that same writer
(tensorboardX's `add_hparams` would open a second one in a subfolder), so a multirun sweep
shows one run per job in both the Scalars and the HParams dashboards; the custom-scalars
layout puts loss, learning rate, gradient norms and throughput on one screen.

Events are written through `SafeSummaryWriter`: when writing fails (disk full), the run never
hangs. With ``logger.on_error=stop`` (the default) it stops cleanly after the current step,
saves its checkpoint and `train.py` exits 2 with `LoggerError`; with ``continue`` it warns once
and trains on without events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from trainers.config.outputs import ON_ERROR
from trainers.core.trainer import Hook, TrainState
from trainers.errors import LoggerError
from trainers.hooks import hparams as hp
from trainers.hooks.logged_scalars import LoggedScalars
from trainers.hooks.tb_writer import SafeSummaryWriter

logger = logging.getLogger(__name__)
# tensorboardX warns on every NaN/inf scalar (a diverging run logs dozens per step); TensorBoard
# shows them, and the run summary reports the non-finite steps.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

FINAL_LOSS_TAG = hp.FINAL_LOSS_TAG


class TensorBoardHook(Hook):
    """Writes every `log_every`-th step's metrics (and all diagnostics) to `logdir`.

    Args:
      logdir: the run's TensorBoard directory.
      log_every: scalar logging period in steps (the last step is always logged).
      global_batch_size: for `perf/examples_per_sec`.
      hparams: ordered hyperparameters for HParams (`trainers.hooks.hparams.hparams`).
      overridden: the hparams the command line overrode (listed first by TensorBoard).
      config_yaml: the resolved config, shown in the Text dashboard.
      num_steps: the run's total steps (to log the last one).
      flush_secs: how often the writer flushes to disk.
      on_error: "stop" or "continue" when events cannot be written (`LoggerOptions`).
      noise_ema_steps: time constant of ``grad/noise_scale_ema`` in steps.
      tokens_per_example: the task's tokens per example, for ``perf/tokens_per_sec``.
      step_flops: returns the compiled step's FLOPs per device (`trainers.hooks.perf.step_flops`),
        or None when unknown; for ``perf/flops_per_sec`` and ``perf/mfu``.
      num_devices: devices running the step (FLOP/s are per device times this).
      peak_flops_per_device: for ``perf/mfu``; None leaves MFU out.
      compile_seconds: returns the run's compile time so far: left out of the throughput.
      best_loss: returns the run's best loss and its step, for the HParams metrics.
      eval_metrics: the evaluation's metric names (``eval/loss``, ...), HParams metrics too.
      eval_results: returns the final and the best evaluation's metrics (None where there
        is none), written as HParams metrics at the end (`trainers.hooks.hparams.eval_metric_tags`).

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
        overridden: frozenset[str] = frozenset(),
        config_yaml: str | None = None,
        flush_secs: float = 10,
        on_error: str = "stop",
        noise_ema_steps: float = 50,
        tokens_per_example: int | None = None,
        step_flops: Callable[[], float | None] | None = None,
        num_devices: int = 1,
        peak_flops_per_device: float | None = None,
        compile_seconds: Callable[[], float | None] | None = None,
        best_loss: Callable[[], tuple[float | None, int | None]] | None = None,
        eval_metrics: tuple[str, ...] = (),
        eval_results: Callable[[], tuple[dict | None, dict | None]] | None = None,
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {list(ON_ERROR)}.")
        self.logdir = logdir
        self.on_error = on_error
        self._reported = False
        self.writer = SafeSummaryWriter(logdir, flush_secs=flush_secs)
        self.num_steps = num_steps
        self.last_loss: float | None = None
        self.last_step: int | None = None
        self.scalars = LoggedScalars(
            log_every=log_every,
            num_steps=num_steps,
            global_batch_size=global_batch_size,
            noise_ema_steps=noise_ema_steps,
            tokens_per_example=tokens_per_example,
            step_flops=step_flops,
            num_devices=num_devices,
            peak_flops_per_device=peak_flops_per_device,
            compile_seconds=compile_seconds,
        )
        self._best_loss = best_loss
        self._eval_results = eval_results
        if config_yaml is not None:
            # Indented lines render as a code block in TensorBoard's markdown.
            self.writer.add_text(
                "config", "\n".join("    " + line for line in config_yaml.splitlines()), 0
            )
        if hparams:
            metrics = hp.METRICS + hp.eval_metric_tags(eval_metrics)
            self.writer.add_summary(hp.experiment_summary(hparams, overridden, metrics))
            self.writer.add_summary(hp.session_start_summary(hparams))
        self.writer.add_custom_scalars(hp.custom_scalars_layout())
        self._hparams = hparams
        self._check()
        if self.writer.failure is not None and on_error == "stop":
            self.writer.close()
            raise LoggerError(self._error_message("before training"))

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
        self.last_step = step
        for tag, value in self.scalars.on_its_step(metrics):
            self.writer.add_scalar(tag, value, step)
        scalars = self.scalars(step, metrics)
        if scalars is None:
            return
        # Everything of a logging step goes out as one event (`SafeSummaryWriter.add_scalars`).
        self.writer.add_scalars(scalars, step)
        self._check()

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Writes an evaluation's metrics (``eval/<name>``) at `step` (an `EvalHook` sink)."""
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()
        self._check()

    def on_diagnostics(self, step: int, diag: dict[str, Any]) -> None:
        norms = [
            (f"layers/{kind}/{name}", float(value))
            for kind, key in (("grad_norm", "grad_norms"), ("param_norm", "param_norms"))
            for name, value in diag.get(key, {}).items()
        ]
        self.writer.add_scalars(norms, step)
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
        step = self.last_step if self.last_step is not None else step
        if self.last_loss is not None:
            self.writer.add_scalar(hp.FINAL_LOSS_TAG, self.last_loss, step)
        best, _ = self._best_loss() if self._best_loss is not None else (None, None)
        if best is not None:
            self.writer.add_scalar(hp.BEST_LOSS_TAG, best, step)
        self.writer.add_scalar(hp.LAST_STEP_TAG, step, step)
        final_eval, best_eval = self._eval_results() if self._eval_results else (None, None)
        for kind, metrics in (("final", final_eval), ("best", best_eval)):
            for name, value in (metrics or {}).items():
                self.writer.add_scalar(hp.eval_metric_tag(kind, name), value, step)
        if self._hparams:
            final_ok = self.last_loss is not None and math.isfinite(self.last_loss)
            self.writer.add_summary(hp.session_end_summary(reason != "error" and final_ok))
        self.close()
        self._check()
        if self.writer.failure is not None and self.on_error == "stop" and reason != "error":
            raise LoggerError(self._error_message(f"at step {step}"))

    def close(self) -> None:
        """Flushes and closes the writer (idempotent; never raises for a failed write)."""
        self.writer.flush()
        self.writer.close()
