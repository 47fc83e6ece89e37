"""Time to the first step: the run's step programs compiled one after another, concurrently, or
lazily (each when first needed). ``python -m benchmarks.compile_modes MODE [--smoke]``.

Each mode runs in a fresh process (`measure_all`), without the persistent compilation cache,
on the default run (``make train``: tiny_gpt, 300 steps, so four step programs: plain,
statistics, per-layer norms, histograms). It prints one JSON line: the seconds from the
trainer's first compile to the end of step 1, and to the end of step `STEPS` with a statistics
step at 10 and 20 and the per-layer norms and histograms at 30 (a lazy run compiles those there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from benchmarks.env import configure_devices

#: The ways to compile the run's programs.
MODES = ("sequential", "concurrent", "lazy")
STEPS = 30
PERIODS = {"stats_every": 10, "layer_stats_every": 30, "histogram_every": 30}


def measure(mode: str, *, smoke: bool) -> dict[str, Any]:
    """Seconds to step 1 and to step `STEPS` with the programs compiled as `mode` says."""
    import jax

    from benchmarks.workloads import make_workload
    from trainers.core.step.levels import levels_in_run, step_level
    from trainers.core.trainer import Trainer
    from xshard.mesh.build import build_mesh

    work = make_workload("tiny_gpt", smoke=smoke)
    mesh = build_mesh(work.cfg.mesh)
    trainer = Trainer(
        work.task, work.xshard_optimizer(mesh), mesh, global_batch_size=work.global_batch_size
    )
    state = trainer.init(*trainer.init_variables(work.host_batches[0]))
    levels = sorted(levels_in_run(1, STEPS, **PERIODS))
    start = time.perf_counter()
    if mode == "sequential":
        for level in levels:
            trainer.compile_levels(state, work.host_batches[0], [level])
    elif mode == "concurrent":
        trainer.compile_levels(state, work.host_batches[0], levels)
    first = None
    for step in range(1, STEPS + 1):
        level = step_level(step, STEPS, **PERIODS)
        batch = work.host_batches[step % len(work.host_batches)]
        state, metrics = trainer.step(
            state, batch, with_stats=level >= 1, layer_stats=level >= 2, histograms=level >= 3
        )
        jax.block_until_ready(state)
        if first is None:
            first = time.perf_counter() - start
    return {
        "mode": mode,
        "programs": len(levels),
        "first_step_s": round(first or 0.0, 3),
        "run_s": round(time.perf_counter() - start, 3),
        "compile_s": round(trainer.compile_seconds or 0.0, 3),
    }


def measure_all(*, smoke: bool, repeats: int = 1) -> list[dict[str, Any]]:
    """`measure` of every mode, each in a fresh process, `repeats` times in turn."""
    out = []
    for _ in range(repeats):
        for mode in MODES:
            argv = [sys.executable, "-m", "benchmarks.compile_modes", mode]
            result = subprocess.run(
                argv + (["--smoke"] if smoke else []),
                capture_output=True,
                text=True,
                check=True,
                env=_no_cache_env(),
            )
            out.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return out


def _no_cache_env() -> dict[str, str]:
    """This process's environment without a persistent compilation cache."""
    import os

    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def main(argv: list[str] | None = None) -> None:
    """Measures one mode (``MODE [--smoke]``) and prints its JSON line."""
    args = sys.argv[1:] if argv is None else argv
    configure_devices()
    print(json.dumps(measure(args[0], smoke="--smoke" in args)))


if __name__ == "__main__":
    main()
