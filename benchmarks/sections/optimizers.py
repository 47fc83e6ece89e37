"""Section 8: the step of Muon, schedule-free AdamW and ADOPT against AdamW's (issue 36).

Each optimizer of `benchmarks.workloads.CLI_OPTIMIZERS` against ``optimizer=adamw`` (the CLI's
default) on tiny_gpt, each composed as ``python -m trainers.train <its overrides>`` composes it
(``optimizer=schedule_free_adamw schedule=constant``: the decaying default schedule is refused;
the others keep the CLI's schedule, reduction and clip; statistics every
``trainer.stats_every`` steps), all interleaved block by block in one process, with paired
ratios (`benchmarks.timing`). The goal `MUON_STEP` is Muon's.
"""

from __future__ import annotations

from typing import Any

import jax
from omegaconf import OmegaConf

from benchmarks.context import Bench
from benchmarks.goals import MUON_STEP
from benchmarks.timing import interleave, ratio
from benchmarks.variants import make_trainer, trainer_loop
from benchmarks.workloads import CLI_OPTIMIZERS, cli_workload
from trainers.config import TrainerOptions
from trainers.core.step import PLAIN, STATS

#: The baseline (the CLI's default optimizer) first, then those compared with it.
OPTIMIZERS = tuple(CLI_OPTIMIZERS)
TASK = "tiny_gpt"
#: `--smoke` only checks that the section runs: the MLP also has hidden matrices for Muon, and
#: its two programs compile in a few seconds where tiny_gpt's take a minute on 2 cores.
SMOKE_TASK = "mlp"


def run(bench: Bench) -> dict[str, Any]:
    """Times each optimizer's step on `TASK` (`SMOKE_TASK` with ``--smoke``); returns step
    times and ratios to adamw."""
    task = SMOKE_TASK if bench.settings.smoke else TASK
    loops = []
    for name in OPTIMIZERS:
        wl = cli_workload(task, CLI_OPTIMIZERS[name], smoke=bench.settings.smoke)
        opts = TrainerOptions(**OmegaConf.to_container(wl.cfg.trainer, resolve=True))
        trainer = make_trainer(wl, bench.mesh(), opts.grad_impl)
        every = opts.stats_every  # null in config: log_every, as the CLI reads it
        params = jax.device_get(trainer.init_params(wl.host_batches[0]))
        level = lambda i, every=every: STATS if i % every == 0 else PLAIN
        loops.append(trainer_loop(name, wl, trainer, params, level))
    timings = interleave(loops, bench.settings.plan(task))
    base = timings[OPTIMIZERS[0]]
    return {
        task: {
            "model": wl.model_config(),
            "devices": bench.max_devices,
            "overrides": {n: list(CLI_OPTIMIZERS[n]) for n in OPTIMIZERS},
            "variants": {n: timings[n].summary() for n in OPTIMIZERS},
            "vs_adamw": {n: ratio(timings[n], base) for n in OPTIMIZERS[1:]},
            "target": {"muon": MUON_STEP},
        }
    }
