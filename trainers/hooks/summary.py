"""What a run did, in a few lines: steps, skipped steps, final and best loss, evaluation, the
checkpoint, the time spent compiling (and how much the compilation cache saved).

`RunSummary` is a hook that records each step's loss and skip flag as the run goes. When the
run ends (done, stopped, or failed), `lines` says what happened and `record` is the same in
JSON form (a job's ``result.json``, `trainers.app.sweep.JobResult`). It comes before every other
hook, the non-finite monitor included, so the step that makes a run diverge is counted too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainers.config.run import EVAL_LOSS, TRAIN_OBJECTIVE
from trainers.core.compile_cache import CacheCounts, cache_counts
from trainers.core.metrics import COMPILE_TIME
from trainers.core.trainer import Hook, TrainState

#: How the run ended, as `status` in ``result.json`` and the sweep table.
COMPLETED = "completed"  # every step trained (or the data ran out)
DIVERGED = "diverged"  # non-finite training stopped the run (NonFiniteError)
FAILED = "failed"  # bad config or input, checkpoint or logger error (exit 2 in a single run)
PREEMPTED = "preempted"  # SIGTERM/SIGINT
CRASHED = "crashed"  # an unexpected error (a bug): a traceback follows


class RunSummary(Hook):
    """Tracks steps, skipped steps and losses of a run; `lines` reports them at the end.

    Created before the run starts, so that an error during start-up is reported too; `begin`
    tells it what the run is once that is known.
    """

    def __init__(self) -> None:
        self.started = False  # whether `begin` was called (start-up got that far)
        self.num_steps = 0
        self.start_step = 0
        self.checkpoint_dir: str | None = None
        self.last_step = 0  # the last step whose metrics were seen
        self.final_loss: float | None = None
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.skipped = 0  # steps skipped (non-finite reduced gradient) in this run
        self.first_skipped: int | None = None
        self.last_skipped: int | None = None
        self.skipped_total: int | None = None  # the optimizer's count, earlier runs included
        self.reason: str | None = None  # the loop's end reason (Trainer.fit)
        self.objective_key = TRAIN_OBJECTIVE  # trainer.objective
        self.final_eval: dict[str, float] | None = None  # the latest evaluation's metrics
        self.final_eval_step: int | None = None
        self.best_eval: dict[str, float] | None = None  # the evaluation with the lowest eval/loss
        self.best_eval_step: int | None = None
        self.compile_seconds: float | None = None  # the train steps' compile time so far
        self.cache_dir: Path | None = None  # the persistent compilation cache, if any
        self.grad_impl: str | None = None  # the gradient path the steps ran
        self.grad_impl_race: dict[str, Any] | None = None  # trainer.grad_impl=auto's race
        self._cache_start = cache_counts()

    def use_compilation_cache(self, directory: Path | None) -> None:
        """The run's compilation cache dir (None: none); its hits and misses count from now."""
        self.cache_dir, self._cache_start = directory, cache_counts()

    def use_grad_impl(self, grad_impl: str, race: dict[str, Any] | None) -> None:
        """The gradient path the run's steps run, and with ``trainer.grad_impl=auto`` what its
        start-up race measured (`trainers.core.path_race.RaceResult` as a dict; None: not
        raced: configured, or the path of the checkpoint resumed from)."""
        self.grad_impl, self.grad_impl_race = grad_impl, race

    @property
    def cache(self) -> CacheCounts:
        """Programs this run read from the compilation cache (hits) and compiled (misses)."""
        return cache_counts().since(self._cache_start)

    def begin(
        self,
        *,
        num_steps: int,
        start_step: int,
        checkpoint_dir: str | None,
        objective: str = TRAIN_OBJECTIVE,
    ) -> None:
        """Called when the run's state is ready, before its first step.

        Args:
          num_steps: the run's ``trainer.steps``.
          start_step: the step the run starts (or resumes) from.
          checkpoint_dir: where the run saves checkpoints; None with checkpoints disabled.
          objective: ``trainer.objective``, what `objective` reports.
        """
        self.started = True
        self.num_steps, self.start_step, self.last_step = num_steps, start_step, start_step
        self.checkpoint_dir = checkpoint_dir
        self.objective_key = objective

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's metrics (`trainers.hooks.evaluation.EvalHook` sink): the latest is the
        final one; the best is the one with the lowest finite ``eval/loss``."""
        self.final_eval, self.final_eval_step = dict(metrics), step
        loss = metrics.get(EVAL_LOSS)
        if (
            loss is not None
            and math.isfinite(loss)
            and (self.best_eval is None or loss < self.best_eval[EVAL_LOSS])
        ):
            self.best_eval, self.best_eval_step = dict(metrics), step

    def eval_results(self) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """(the final evaluation's metrics, the best evaluation's), None where there is none."""
        return self.final_eval, self.best_eval

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step = step
        if COMPILE_TIME in metrics:
            self.compile_seconds = metrics[COMPILE_TIME]
        loss = metrics.get("train/loss")
        if loss is not None:
            self.final_loss = loss
            if math.isfinite(loss) and (self.best_loss is None or loss < self.best_loss):
                self.best_loss, self.best_step = loss, step
        if metrics.get("train/consecutive_skipped", 0) > 0:  # this very step was skipped
            self.skipped += 1
            self.first_skipped = step if self.first_skipped is None else self.first_skipped
            self.last_skipped = step
        if "train/skipped_steps" in metrics:
            self.skipped_total = int(metrics["train/skipped_steps"])

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        self.reason = reason

    # ------------------------------------------------------------------ reading it back

    @property
    def trained(self) -> int:
        """Steps trained by this run (after a resume, those after `start_step`)."""
        return self.last_step - self.start_step

    @property
    def objective(self) -> float | None:
        """``trainer.objective``: the final training loss, or that metric of the final
        evaluation; None if there is none or it is not finite (a sweeper never gets NaN or
        inf)."""
        if self.objective_key == TRAIN_OBJECTIVE:
            value = self.final_loss
        else:
            value = (self.final_eval or {}).get(self.objective_key)
        if value is None or not math.isfinite(value):
            return None
        return value

    def checkpoint(self) -> tuple[int, str] | None:
        """(step, path) of the latest complete checkpoint in the run's dir, or None."""
        if self.checkpoint_dir is None or not Path(self.checkpoint_dir).is_dir():
            return None
        from trainers.checkpoint.io import complete_steps

        steps = complete_steps(self.checkpoint_dir)
        if not steps:
            return None
        return steps[-1], str(Path(self.checkpoint_dir) / str(steps[-1]))

    def checkpoint_line(self) -> str:
        """Where the result is: the latest checkpoint, or why there is none."""
        found = self.checkpoint()
        if found is not None:
            step, path = found
            note = "" if step == self.last_step else f" (the last step, {self.last_step}, is not)"
            return f"checkpoint: step {step} in {path}{note}"
        if self.checkpoint_dir is None:
            return "checkpoint: none (checkpoint.enabled=false)"
        return f"checkpoint: none written in {self.checkpoint_dir}"

    def lines(self, status: str, message: str | None = None) -> list[str]:
        """The run's closing lines: how it ended, losses, skipped steps, the checkpoint, the
        evaluation.

        Args:
          status: one of `COMPLETED`, `DIVERGED`, `FAILED`, `PREEMPTED`, `CRASHED`.
          message: the error that ended the run, if any (one line).
        """
        if not self.started:
            return [
                f"Run {status} during start-up, before any step"
                + (f": {message}" if message else ".")
            ]
        how = f"{status} ({self.reason})" if status == COMPLETED and self.reason else status
        head = (
            f"Run {how} at step {self.last_step} of {self.num_steps} "
            f"({self.trained} trained in this run)"
        )
        out = [head + (f": {message}" if message else ".")]
        if self.final_loss is None:
            out.append("  loss: no step finished")
        else:
            best = (
                f"best {format_loss(self.best_loss)} (step {self.best_step})"
                if self.best_loss is not None
                else "no finite loss"
            )
            out.append(
                f"  loss: final {format_loss(self.final_loss)} (step {self.last_step}), {best}"
            )
        if self.skipped:
            total = (
                f", {self.skipped_total} in all"
                if self.skipped_total and self.skipped_total != self.skipped
                else ""
            )
            out.append(
                f"  skipped steps: {self.skipped} with a non-finite gradient{total} (first "
                f"step {self.first_skipped}, last step {self.last_skipped})"
            )
        else:
            out.append("  skipped steps: none")
        out.append("  " + self.checkpoint_line())
        out.extend(self.eval_lines())
        out.append("  " + self.compile_line())
        return out

    def compile_line(self) -> str:
        """The train steps' compile time, and the programs read from the compilation cache."""
        seconds = "-" if self.compile_seconds is None else f"{self.compile_seconds:.2f} s"
        if self.cache_dir is None:
            return f"compile: {seconds} (no compilation cache)"
        hits, misses = self.cache
        return (
            f"compile: {seconds}; compilation cache {self.cache_dir}: {hits} programs read, "
            f"{misses} compiled"
        )

    def eval_lines(self) -> list[str]:
        """The final and best evaluation, if the run evaluated."""
        if self.final_eval is None:
            return []

        def shown(metrics: dict[str, float]) -> str:
            return ", ".join(f"{k} {format_loss(v)}" for k, v in metrics.items())

        out = [f"  eval: final {shown(self.final_eval)} (step {self.final_eval_step})"]
        if self.best_eval is not None and self.best_eval_step != self.final_eval_step:
            out.append(f"  eval: best {shown(self.best_eval)} (step {self.best_eval_step})")
        return out

    def record(self, status: str, message: str | None = None) -> dict[str, Any]:
        """The same facts as `lines`, as a JSON-ready dict."""
        found = self.checkpoint()
        return {
            "status": status,
            "reason": message or self.reason,
            "last_step": self.last_step,
            "num_steps": self.num_steps,
            "start_step": self.start_step,
            "final_loss": _finite_or_none(self.final_loss),
            "best_loss": self.best_loss,
            "best_step": self.best_step,
            "skipped_steps": self.skipped,
            "first_skipped_step": self.first_skipped,
            "last_skipped_step": self.last_skipped,
            "eval": _finite_values(self.final_eval),
            "eval_step": self.final_eval_step,
            "best_eval": _finite_values(self.best_eval),
            "best_eval_step": self.best_eval_step,
            "objective_key": self.objective_key,
            "checkpoint": None if found is None else found[1],
            "compile_time_s": self.compile_seconds,
            "compilation_cache": None if self.cache_dir is None else str(self.cache_dir),
            "compilation_cache_hits": self.cache.hits,
            "compilation_cache_misses": self.cache.misses,
            "grad_impl": self.grad_impl,
            "grad_impl_race": self.grad_impl_race,
        }


def format_loss(value: float | None) -> str:
    """A loss as the run summary and the progress bar show it (5 significant digits)."""
    return "-" if value is None else f"{value:.5g}"


def _finite_values(metrics: dict[str, float] | None) -> dict[str, Any] | None:
    """`metrics` for JSON (`_finite_or_none` of each value)."""
    return None if metrics is None else {k: _finite_or_none(v) for k, v in metrics.items()}


def _finite_or_none(value: float | None) -> float | str | None:
    """JSON has no NaN/inf: those are written as strings ("nan", "inf")."""
    if value is None or math.isfinite(value):
        return value
    return str(value)
