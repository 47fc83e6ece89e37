"""Section 6: host overhead of `Trainer.fit` against a bare loop over the same compiled step.

On the smallest model (mlp), where a step is a few milliseconds and the host matters most,
the loops share one `Trainer` (so one compiled step), each with its own state, fed the same
host (NumPy) batches:

* ``bare_loop`` — ``state, m = trainer.step(state, batch)``, blocking every 10 steps;
* ``bare_loop_device_batches`` — the same fed batches already on the devices: the difference
  to ``bare_loop`` is the host-to-device placement of each batch, which every loop pays;
* ``fit_no_hooks`` — `Trainer.fit` with no hooks (it fetches each step's metrics one step late);
* ``fit_hooks`` — `Trainer.fit` with the CLI's hooks: `TensorBoardHook` (log_every=10, to a
  temporary directory), `ProgressHook` (enabled, drawing to /dev/null) and `NonFiniteMonitor`.

A block is one `fit` call of `steps_per_block` steps (the bare loop: as many steps); hooks
live across blocks (their `on_end` is not called per block), so only the loop's per-call
overhead (reading ``state.step`` at the start and end) is added, and it counts against fit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from typing import Any

import jax

from benchmarks.context import Bench
from benchmarks.timing import interleave, ratio
from trainers.monitor import NonFiniteMonitor, ProgressHook
from trainers.tb_logger import TensorBoardHook
from trainers.trainer import Hook, Trainer

TASK = "mlp"
SYNC_EVERY = 10


class BareLoop:
    """`Trainer.step` in a plain Python loop, blocking every `SYNC_EVERY` steps."""

    def __init__(self, name: str, trainer: Trainer, state: Any, batches: list[Any]):
        self.name, self.trainer, self.state = name, trainer, state
        self.batches = itertools.cycle(batches)

    def run(self, steps: int) -> None:
        metrics = None
        for i in range(steps):
            self.state, metrics = self.trainer.step(self.state, next(self.batches))
            if (i + 1) % SYNC_EVERY == 0:
                jax.block_until_ready(metrics)
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
        self.state, reason = self.trainer.fit(
            self.state, self.batches, num_steps=self.done, hooks=self.hooks
        )
        if reason != "done":
            raise RuntimeError(f"fit ended with {reason!r}")
        jax.block_until_ready(self.state)


def run(bench: Bench) -> dict[str, Any]:
    """Returns per-step times of the loops and fit's overhead over the bare loop."""
    wl = bench.workload(TASK)
    trainer = bench.loop(TASK, "xshard_trainer").trainer  # compiled already
    params = bench.initial_params(TASK)
    plan = bench.settings.plan(TASK, "host")
    total = plan.steps_per_block * (plan.warmup_blocks + plan.rounds) + 1
    with tempfile.TemporaryDirectory() as tb_dir, open(os.devnull, "w") as devnull:
        tb = TensorBoardHook(
            tb_dir,
            log_every=int(wl.cfg.trainer.log_every),
            global_batch_size=wl.global_batch_size,
            num_steps=total,
            flush_secs=int(wl.cfg.logger.flush_secs),
        )
        with contextlib.redirect_stderr(devnull):  # tqdm binds its stream at construction
            progress = ProgressHook(start_step=0, num_steps=total, enabled=True)
        monitor = NonFiniteMonitor(
            skip_nonfinite=bool(wl.cfg.reduction.skip_nonfinite),
            max_consecutive=int(wl.cfg.trainer.max_consecutive_nonfinite),
        )
        hooks = [KeepOpen(h) for h in (monitor, tb, progress)]
        loops = [
            BareLoop("bare_loop", trainer, trainer.init(params), wl.host_batches),
            BareLoop(
                "bare_loop_device_batches",
                trainer,
                trainer.init(params),
                [trainer.global_batch(b) for b in wl.host_batches],
            ),
            FitLoop("fit_no_hooks", trainer, trainer.init(params), wl.host_batches, []),
            FitLoop("fit_hooks", trainer, trainer.init(params), wl.host_batches, hooks),
        ]
        try:
            timings = interleave(loops, plan)
        finally:
            progress.bar.close()
            tb.close()
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
