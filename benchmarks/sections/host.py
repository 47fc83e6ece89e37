"""Section 6: host overhead of `Trainer.fit` against a bare loop over the same compiled step.

On the smallest model (mlp), where a step is a few milliseconds and the host matters most,
the loops share one `Trainer` (so one compiled step), each with its own state, fed the same
host (NumPy) batches:

* ``bare_loop`` — ``state, m = trainer.step(state, batch)``, blocking every 10 steps, at the
  statistics level `fit` runs each step by default (its default ``stats_every``: statistics
  on every ``stats_every``-th step and on the last step of each call);
* ``bare_loop_device_batches`` — the same fed batches already on the devices: the difference
  to ``bare_loop`` is the host-to-device placement of each batch, which every loop pays;
* ``fit_no_hooks`` — `Trainer.fit` with no hooks (it fetches each step's metrics one step late);
* ``fit_hooks`` — `Trainer.fit` with the CLI's hooks, in the CLI's order: `RunSummary`,
  `NonFiniteMonitor`, `LoggerHook` (TensorBoard, log_every=10, to a temporary directory),
  `ProgressHook` (enabled, drawing to /dev/null) and an idle `CheckpointHook` (the CLI's
  checkpoint options from the composed config, to a temporary directory, ``every_steps``
  beyond the run: it never saves while timed).

A block is one `fit` call of `steps_per_block` steps (the bare loop: as many steps); hooks
live across blocks (their `on_end` is not called per block), so only the loop's per-call
overhead (reading ``state.step`` at the start and end) is added, and it counts against fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import os
import tempfile
from typing import Any

import jax

from benchmarks.context import Bench
from benchmarks.timing import interleave, ratio
from trainers.checkpoint.save import CheckpointHook
from trainers.config import CheckpointOptions
from trainers.config.plain import run_config
from trainers.core.step import STATS
from trainers.core.step.levels import step_level
from trainers.core.trainer import Hook, Trainer
from trainers.hooks.log_sink import RunInfo
from trainers.hooks.logged_scalars import LoggedScalars, ScalarOptions
from trainers.hooks.monitor import NonFiniteMonitor, ProgressHook
from trainers.hooks.run_logger import LoggerHook
from trainers.hooks.summary import RunSummary
from trainers.hooks.tensorboard import TensorBoardSink

TASK = "mlp"
SYNC_EVERY = 10
#: `fit`'s default statistics period, which the fit loops run and the bare loops copy.
STATS_EVERY = inspect.signature(Trainer.fit).parameters["stats_every"].default


class BareLoop:
    """`Trainer.step` in a plain Python loop, blocking every `SYNC_EVERY` steps.

    Each step runs at the level `fit` would run it with its default `STATS_EVERY` (a block
    is one `fit` call, whose last step always computes the statistics).
    """

    def __init__(self, name: str, trainer: Trainer, state: Any, batches: list[Any]):
        self.name, self.trainer, self.state = name, trainer, state
        self.batches = itertools.cycle(batches)
        self.done = int(jax.device_get(state.step))

    def run(self, steps: int) -> None:
        metrics = None
        end = self.done + steps
        for i in range(steps):
            level = step_level(
                self.done + i + 1,
                end,
                stats_every=STATS_EVERY,
                layer_stats_every=0,
                histogram_every=0,
            )
            self.state, metrics = self.trainer.step(
                self.state, next(self.batches), with_stats=level >= STATS
            )
            if (i + 1) % SYNC_EVERY == 0:
                jax.block_until_ready(metrics)
        self.done = end
        jax.block_until_ready((self.state, metrics))


class KeepOpen(Hook):
    """Forwards everything but `on_end` to `hook`, so it outlives one `fit` call."""

    def __init__(self, hook: Hook):
        self.hook = hook

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.hook.on_step(step, metrics)

    def on_diagnostics(self, step: int, diag: dict[str, Any]) -> None:
        self.hook.on_diagnostics(step, diag)

    def wants_state(self, step: int) -> bool:
        return self.hook.wants_state(step)

    def on_state(self, step: int, state: Any) -> None:
        self.hook.on_state(step, state)


class FitLoop:
    """`Trainer.fit` for `steps` more steps per block."""

    def __init__(self, name: str, trainer: Trainer, state: Any, batches: list[dict], hooks):
        self.name, self.trainer, self.state, self.hooks = name, trainer, state, list(hooks)
        self.batches = itertools.cycle(batches)
        self.done = int(jax.device_get(state.step))

    def run(self, steps: int) -> None:
        self.done += steps
        result = self.trainer.fit(self.state, self.batches, num_steps=self.done, hooks=self.hooks)
        self.state, reason = result.state, result.reason
        if reason != "done":
            raise RuntimeError(f"fit ended with {reason!r}")
        jax.block_until_ready(self.state)


def tensorboard_hook(
    tb_dir: str, cfg: Any, global_batch_size: int, total: int, summary: RunSummary
) -> LoggerHook:
    """The CLI's logging hook writing to TensorBoard only, with the config's period."""
    scalars = ScalarOptions(
        log_every=int(cfg.trainer.log_every),
        num_steps=total,
        global_batch_size=global_batch_size,
    )
    sink = TensorBoardSink(tb_dir, flush_secs=float(cfg.logger.flush_secs))
    return LoggerHook([sink], RunInfo(), LoggedScalars(scalars), summary)


def run(bench: Bench) -> dict[str, Any]:
    """Returns per-step times of the loops and fit's overhead over the bare loop."""
    wl = bench.workload(TASK)
    trainer = bench.loop(TASK, "xshard_trainer").trainer  # compiled already
    params = bench.initial_params(TASK)
    plan = bench.settings.plan(TASK, "host")
    total = plan.steps_per_block * (plan.warmup_blocks + plan.rounds) + 1
    # The CLI's checkpoint options; saving only beyond the run keeps the hook idle.
    ckpt_options = dataclasses.replace(
        CheckpointOptions.from_config(wl.cfg.checkpoint), every_steps=total + 1
    )
    fit_state = trainer.init(params)
    with contextlib.ExitStack() as stack:
        tb_dir = stack.enter_context(tempfile.TemporaryDirectory())
        ckpt_dir = stack.enter_context(tempfile.TemporaryDirectory())
        devnull = stack.enter_context(open(os.devnull, "w"))
        summary = RunSummary()
        summary.begin(num_steps=total, start_step=0, checkpoint_dir=ckpt_dir)
        tb = tensorboard_hook(tb_dir, wl.cfg, wl.global_batch_size, total, summary)
        stack.callback(tb.on_end, total, None, "done")
        with contextlib.redirect_stderr(devnull):  # tqdm binds its stream at construction
            progress = ProgressHook(start_step=0, num_steps=total, enabled=True)
        stack.callback(progress.bar.close)
        monitor = NonFiniteMonitor(
            skip_nonfinite=bool(wl.cfg.reduction.skip_nonfinite),
            max_consecutive=int(wl.cfg.trainer.max_consecutive_nonfinite),
        )
        checkpoints = CheckpointHook(ckpt_dir, ckpt_options, run_config(wl.cfg))
        stack.callback(checkpoints.close)
        checkpoints.prepare(fit_state)  # as train.py does
        hooks = [KeepOpen(h) for h in (summary, monitor, tb, progress, checkpoints)]
        loops = [
            BareLoop("bare_loop", trainer, trainer.init(params), wl.host_batches),
            BareLoop(
                "bare_loop_device_batches",
                trainer,
                trainer.init(params),
                [trainer.global_batch(b) for b in wl.host_batches],
            ),
            FitLoop("fit_no_hooks", trainer, trainer.init(params), wl.host_batches, []),
            FitLoop("fit_hooks", trainer, fit_state, wl.host_batches, hooks),
        ]
        timings = interleave(loops, plan)
        if checkpoints.last_saved is not None:
            raise RuntimeError(f"the idle checkpoint hook saved step {checkpoints.last_saved}")
    bare = timings["bare_loop"]
    med = {n: t.summary()["median_ms"] for n, t in timings.items()}
    return {
        "task": TASK,
        "model": wl.model_config(),
        "variants": {n: t.summary() for n, t in timings.items()},
        "fit_hooks_vs_bare": ratio(timings["fit_hooks"], bare),
        "fit_no_hooks_vs_bare": ratio(timings["fit_no_hooks"], bare),
        "fit_hooks_overhead_us_per_step": round((med["fit_hooks"] - med["bare_loop"]) * 1e3, 1),
        "batch_placement_us_per_step": round(
            (med["bare_loop"] - med["bare_loop_device_batches"]) * 1e3, 1
        ),
        "hooks_cost_us_per_step": round((med["fit_hooks"] - med["fit_no_hooks"]) * 1e3, 1),
    }
