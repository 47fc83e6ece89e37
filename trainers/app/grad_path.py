"""``trainer.grad_impl=auto`` (the default): the gradient path a run keeps.

`trainers.app.builders.path_trainers` builds a `Trainer` per path the config can run
(`build_run`); `choose_path`, once the state is ready, keeps one of them:

* a resumed run keeps the path saved in its checkpoint's config (the run that wrote it
  resolved ``auto`` to it): it runs the same program and times nothing;
* a path the config refuses (per-shard clipping or a periodic axis's warm-up need the
  manual path's per-shard gradients) is left out with a log line saying why;
* a run whose plain programs an earlier run on this kind of machine raced keeps that run's
  choice, remembered in the compilation cache dir (`trainers.app.race_memory`): it compiles
  and times neither path again;
* otherwise both plain programs are compiled and raced for a bounded time
  (`trainers.core.path_race`) on a copy of the state, the faster is kept and the choice
  remembered.

The choice is logged, written to ``result.json`` (`RunSummary.use_grad_impl`) and saved in the
checkpoints' config as ``trainer.grad_impl`` (`trainers.checkpoint.compat.RESOLVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
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
    cache_dir: Path | None = None,
) -> tuple[RunParts, Started]:
    """The run's parts with the trainer of the path it keeps, and its start with the path in
    the config its checkpoints save; `summary` records it. Only ``auto`` chooses; a race's
    choice is remembered in `cache_dir` (the compilation cache's; None: not remembered).

    Raises:
      ConfigError: if no path's program compiles (the first path's error), or a compiled
        step needs more memory than there is (`StepMemoryCheck`, before any timed step).
    """
    from trainers.checkpoint.resume import saved_config

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
        chosen, record = _race(options, where, parts, started, cache_dir)
    config = dict(started.config)
    config["trainer"] = {**config.get("trainer", {}), "grad_impl": chosen}
    summary.use_grad_impl(chosen, record)
    trainer = parts.paths[chosen]
    periodic = trainer.periodic_programs  # `Trainer.init` prepared the first path's only
    if trainer is not parts.trainer and periodic is not None:
        periodic.prepare(trainer.state_shapes(started.first).params)
    return dataclasses.replace(parts, trainer=trainer), started._replace(config=config)


def _race(
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    cache_dir: Path | None,
) -> tuple[str, dict[str, Any]]:
    """The path the race of `parts.paths` keeps, remembered (process 0 reads and writes the
    memory, `trainers.app.race_memory`) or raced now, and its record for ``result.json``."""
    from trainers.app.race_memory import recall, remember
    from trainers.core.path_race import race, race_key

    key, recalled = None, None
    if cache_dir is not None and where.cluster.lead:
        key = race_key(parts.paths, started.state, started.first)
        recalled = None if key is None else recall(cache_dir, key, parts.paths)
    # One exchange of the run, like the race's own: every process keeps the same path.
    recalled = where.cluster.broadcast("grad_impl_memory (trainer.grad_impl=auto)", recalled)
    if recalled is not None:
        _log_recalled(recalled)
        return recalled["chosen"], recalled
    # Before any timed step, as before the run's first step; its own name for the
    # processes' agreement (each name is one exchange of the run).
    agreed = lambda what: where.cluster.agreed(f"{what} (trainer.grad_impl=auto)")
    memory = StepMemoryCheck(where.mesh.local_devices, options.trainer.batch_size, agreed)
    run = options.trainer
    found = race(
        parts.paths,
        started.state,
        started.first,
        agree=where.cluster.broadcast,
        check=memory.on_compiled,
        ahead=lambda trainer: trainer.compile_run(  # what `fit` compiles before step 1
            started.state, started.first, started.start_step + 1, run.steps, run.stat_periods
        ),
    )
    _log_race(found)
    if cache_dir is not None and key is not None and found.ms_per_step:  # timed
        remember(cache_dir, key, found._asdict())
    return found.chosen, found._asdict()


def _log_recalled(record: dict[str, Any]) -> None:
    """The log line of a remembered race (`trainers.app.race_memory.recall`'s record)."""
    from trainers.app.race_memory import RACED_AT, REMEMBERED

    timed = ", ".join(f"{name} {ms:.3g} ms" for name, ms in record["ms_per_step"].items())
    log.info(
        "trainer.grad_impl=auto: %s, the faster plain step when these programs were raced "
        "on this kind of machine (%s on %s; remembered in %s: not raced again, delete the "
        "file to race again).",
        record["chosen"],
        timed,
        record.get(RACED_AT, "at an unknown time"),
        record[REMEMBERED],
    )


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
        "steps; compiling both, the first path's other programs with them, and timing took "
        "%.1f s).",
        found.chosen,
        timed,
        found.steps_per_block,
        found.seconds,
    )
