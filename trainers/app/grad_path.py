"""``trainer.grad_impl=auto`` (the default): the gradient path a run keeps.

`trainers.app.builders.path_trainers` builds a `Trainer` per path the config can run
(`build_run`); `choose_path`, once the state is ready, keeps one of them:

* a resumed run keeps the path saved in its checkpoint's config (the run that wrote it
  resolved ``auto`` to it): it runs the same program and times nothing;
* a path the config refuses (per-shard clipping or a periodic axis's warm-up need the
  manual path's per-shard gradients) is left out with a log line saying why;
* otherwise both plain programs are compiled and raced for a bounded time
  (`trainers.core.path_race`) on a copy of the state, and the faster is kept.

The choice is logged, written to ``result.json`` (`RunSummary.use_grad_impl`) and saved in the
checkpoints' config as ``trainer.grad_impl`` (`trainers.checkpoint.compat.RESOLVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from trainers.app.builders import RunOptions, RunParts
from trainers.app.memory_preflight import StepMemoryCheck
from trainers.app.stages import Placement, Started
from trainers.config.run import GRAD_IMPL_AUTO
from trainers.hooks.summary import RunSummary

log = logging.getLogger("trainers.train")


def choose_path(
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    source: Any,
    summary: RunSummary,
) -> tuple[RunParts, Started]:
    """The run's parts with the trainer of the path it keeps, and its start with the path in
    the config its checkpoints save; `summary` records it. Only ``auto`` chooses.

    Raises:
      ConfigError: if no path's program compiles (the first path's error), or a compiled
        step needs more memory than there is (`StepMemoryCheck`, before any timed step).
    """
    from trainers.checkpoint.resume import saved_config
    from trainers.core.path_race import race

    configured = options.trainer.grad_impl
    if configured != GRAD_IMPL_AUTO:
        summary.use_grad_impl(configured, None)
        return parts, started
    saved = None
    if source is not None:
        saved = saved_config(source, started.start_step).get("trainer", {}).get("grad_impl")
    if saved in parts.paths:
        chosen, record = saved, None
        log.info(
            "trainer.grad_impl=auto: %s, the path of the checkpoint of step %d (not timed again).",
            chosen,
            started.start_step,
        )
    elif len(parts.paths) == 1:  # the others refused at build, or a population's trial
        chosen, record = next(iter(parts.paths)), None
        log.info("trainer.grad_impl=auto: %s, the only path this run takes (not timed).", chosen)
    else:
        # Before any timed step, as before the run's first step; its own name for the
        # processes' agreement (each name is one exchange of the run).
        agreed = lambda what: where.cluster.agreed(f"{what} (trainer.grad_impl=auto)")
        memory = StepMemoryCheck(where.mesh.local_devices, options.trainer.batch_size, agreed)
        found = race(
            parts.paths,
            started.state,
            started.first,
            agree=where.cluster.broadcast,
            check=memory.on_compiled,
        )
        chosen, record = found.chosen, found._asdict()
        _log_race(found)
    config = dict(started.config)
    config["trainer"] = {**config.get("trainer", {}), "grad_impl": chosen}
    summary.use_grad_impl(chosen, record)
    trainer = parts.paths[chosen]
    periodic = trainer.periodic_programs  # `Trainer.init` prepared the first path's only
    if trainer is not parts.trainer and periodic is not None:
        periodic.prepare(trainer.state_shapes(started.first).params)
    return dataclasses.replace(parts, trainer=trainer), started._replace(config=config)


def _log_race(found: Any) -> None:
    """The race's log line (`trainers.core.path_race.RaceResult`)."""
    for name, why in found.refused.items():
        log.info("trainer.grad_impl=auto: not %s: %s", name, why)
    if not found.ms_per_step:
        log.info(
            "trainer.grad_impl=auto: %s, the only path this config runs (%.1f s to compile).",
            found.chosen,
            found.seconds,
        )
        return
    timed = ", ".join(f"{name} {ms:.3g} ms" for name, ms in found.ms_per_step.items())
    log.info(
        "trainer.grad_impl=auto: %s, the faster plain step (%s; medians of blocks of %d "
        "steps; compiling and timing both took %.1f s).",
        found.chosen,
        timed,
        found.steps_per_block,
        found.seconds,
    )
