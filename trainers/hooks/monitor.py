"""Hooks that watch the run: the progress bar (or, off a terminal, progress lines) and the
non-finite guard's limits."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainers.core.trainer import Hook, TrainState
from trainers.exits import NonFiniteError
from trainers.hooks.summary import format_loss

log = logging.getLogger("trainers.train")


class NonFiniteMonitor(Hook):
    """Stops the run when training goes bad.

    * a non-finite loss or reduced gradient while the optimizer does not skip non-finite
      steps (``reduction.skip_nonfinite=false``): the params of that step are already bad;
    * more than `max_consecutive` skipped (non-finite) steps in a row.

    It raises `NonFiniteError` from `on_step`, and `Trainer.fit` hands a state to the
    checkpoint hook only after every hook saw that state's metrics: no checkpoint of a bad
    step is written.

    Args:
      skip_nonfinite: whether the optimizer skips steps with a non-finite reduced gradient.
      max_consecutive: how many skipped steps in a row are tolerated (``>= 0``; the config's
        ``trainer.max_consecutive_nonfinite``, checked by `xshard.config.TrainerOptions`).
    """

    def __init__(self, *, skip_nonfinite: bool, max_consecutive: int):
        self.skip_nonfinite = skip_nonfinite
        self.max_consecutive = max_consecutive
        self.last_loss = float("nan")  # the run's final loss, for the Hydra main

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_loss = metrics.get("train/loss", self.last_loss)
        if not self.skip_nonfinite:
            loss = metrics.get("train/loss", 0.0)
            bad_grads = metrics.get("grad/nonfinite", 0.0)
            if not math.isfinite(loss) or bad_grads:
                what = (
                    f"loss {loss}"
                    if not math.isfinite(loss)
                    else f"{bad_grads:.0f} gradient values"
                )
                raise NonFiniteError(
                    f"Non-finite {what} at step {step} with reduction.skip_nonfinite=false: "
                    "stopping (the params of this step are not saved). Set "
                    "reduction.skip_nonfinite=true to skip such steps instead."
                )
            return
        run = int(metrics.get("train/consecutive_skipped", 0))
        if run > self.max_consecutive:
            raise NonFiniteError(
                f"{run} consecutive steps with a non-finite gradient were skipped (up to step "
                f"{step}), more than trainer.max_consecutive_nonfinite={self.max_consecutive}: "
                "stopping. Check the data and the learning rate."
            )


class ProgressHook(Hook):
    """A tqdm progress bar on stderr: steps, steps/s (tqdm's rate), loss; off a terminal, log
    lines instead.

    While the bar is shown, console log records are written through `tqdm.write`
    (`tqdm.contrib.logging.logging_redirect_tqdm`), above the bar instead of onto it. When the
    run ends the bar shows the last step's loss, as the run summary does (`format_loss`).

    When stderr is not a terminal (CI logs, ``nohup``, a file) a bar's redraws would
    interleave with the log lines, so there is no bar: a line ``Progress: step 30/300 (10%),
    loss 2.712, 10.4 steps/s`` is logged at each tenth of the run and at least every
    `LINE_SECONDS` seconds.

    Args:
      start_step: the step the run starts from.
      num_steps: the run's last step.
      enabled: show progress at all (``trainer.progress``).
      terminal: whether stderr is a terminal; None: ask it (``isatty``).
    """

    #: The longest time between two progress lines off a terminal (seconds).
    LINE_SECONDS = 60.0

    def __init__(
        self,
        *,
        start_step: int,
        num_steps: int,
        enabled: bool = True,
        terminal: bool | None = None,
    ):
        terminal = sys.stderr.isatty() if terminal is None else terminal
        bar = enabled and terminal
        self._lines = enabled and not terminal
        self._redirect = logging_redirect_tqdm() if bar else contextlib.nullcontext()
        self._redirect.__enter__()
        self._loss: float | None = None
        self.num_steps = num_steps
        self.bar = tqdm(
            total=num_steps,
            initial=start_step,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not bar,
            mininterval=0.5,
            dynamic_ncols=True,
        )
        self._shown = time.perf_counter()  # when the bar's loss was last set
        self._last_line = (start_step, self._shown)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.bar.update(step - self.bar.n)
        self._loss = metrics.get("train/loss", self._loss)
        if self._lines:
            self._log_line(step)
            return
        now = time.perf_counter()
        if now - self._shown >= 1.0:  # the rate is tqdm's own (``step/s``)
            self.bar.set_postfix({"loss": format_loss(self._loss)}, refresh=False)
            self._shown = now

    def _log_line(self, step: int) -> None:
        """A progress line at each tenth of the run, the last step, or `LINE_SECONDS` after
        the previous line."""
        last_step, last_time = self._last_line
        now = time.perf_counter()
        tenth = 10 * step // self.num_steps > 10 * last_step // self.num_steps
        if not (tenth or step == self.num_steps or now - last_time >= self.LINE_SECONDS):
            return
        rate = (step - last_step) / (now - last_time) if now > last_time else 0.0
        log.info(
            "Progress: step %d/%d (%d%%), loss %s, %.1f steps/s",
            step,
            self.num_steps,
            100 * step // self.num_steps,
            format_loss(self._loss),
            rate,
        )
        self._last_line = (step, now)

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        try:
            if self._loss is not None and not self._lines:  # as the run summary says
                self.bar.set_postfix({"loss": format_loss(self._loss)})
            self.bar.close()
        finally:
            self._redirect.__exit__(None, None, None)
