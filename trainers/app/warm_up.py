"""What a run prepares before its state is restored or joined (`trainers.app.training`): the
first batch (once the state and a step fit in memory), a new state, the evaluator with its
eval step compiled. Nothing is written and no peer is met: an elastic group's warm standby
does all of it before it takes over (`trainers.cluster.standby`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

from omegaconf import DictConfig

from trainers.app.builders import RunOptions, RunParts
from trainers.app.stages import Placement

log = logging.getLogger("trainers.train")


class Warm(NamedTuple):
    """What a run prepares before its state is restored or joined: the first batch, the new
    state, the evaluator (its eval step compiled; None: no evaluation)."""

    first: Any
    state: Any
    evaluator: Any


def warm_up(cfg: DictConfig, options: RunOptions, where: Placement, parts: RunParts) -> Warm:
    """The first batch, a new state and the run's evaluator: nothing written, no peer met.

    Raises:
      ConfigError: if the data yields no batch, or a bad eval split or trainer.objective.
    """
    from trainers.core.zero import state_report
    from trainers.hooks.evaluation import build_evaluator

    trainer, cluster = parts.trainer, where.cluster
    first = first_batch(cfg, options, where, parts)
    state = trainer.init(*trainer.init_variables(first))
    if cluster.lead:
        log.info("%s", state_report(trainer.layout, state))
    # Compiled now: a bad eval split or trainer.objective fails before training (and before
    # an elastic group joins its peers, who would wait for it at their next sync).
    evaluator = build_evaluator(
        parts.task,
        where.mesh,
        state,
        data_axes=where.data_axes,
        opts=options.trainer,
        seed=options.seed,
        compute_dtype=trainer.precision.compute_dtype,
        all_gather=cluster.all_gather,
    )
    return Warm(first, state, evaluator)


def batches(options: RunOptions, parts: RunParts, start_step: int) -> Iterator[Any]:
    """This process's training batches from `start_step` on."""
    import jax

    return parts.task.batches(
        options.trainer.batch_size,
        seed=options.seed if options.data_seed is None else options.data_seed,
        start_step=start_step,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def first_batch(cfg: DictConfig, options: RunOptions, where: Placement, parts: RunParts) -> Any:
    """The first training batch, once the state and a step fit in the devices' memory and a
    batch in the host's (from the task's declared shapes if it has them, else from the batch).

    Raises:
      ConfigError: naming ``trainer.batch_size`` (or the memory) if they do not fit, or the
        task if its data yields no batch.
    """
    import jax

    from trainers.app.memory_preflight import check_state_memory, example_shapes
    from trainers.app.population_run import trial_seat
    from trainers.app.preflight import check_batch_fits
    from xshard.errors import ConfigError
    from xshard.mesh.build import data_parallel_size

    task, opts, seed = parts.task, options.trainer, options.seed
    shards = data_parallel_size(where.mesh, where.data_axes)

    seat = trial_seat()  # a population's trials hold their states together
    trials = 1 if seat is None else seat.population.size

    def check_memory(batch: Any) -> None:  # the state and a step, from shapes (no arrays)
        with where.cluster.agreed("checking the memory for the training state"):
            check_state_memory(
                parts.trainer,
                batch,
                opts.batch_size,
                shards,
                cfg.task,
                where.mesh.local_devices,
                trials,
            )

    declared = example_shapes(task)  # then checked before any data is made
    if declared is not None:
        check_memory({k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in declared.items()})
    check_batch_fits(
        lambda size: task.batches(size, seed=seed, process_count=jax.process_count()),
        opts.batch_size,
        probe_batch=shards,
        process_count=jax.process_count(),
    )
    first = next(iter(batches(options, parts, 0)), None)
    if first is None:
        raise ConfigError(
            f"task={cfg.task.get('name', 'task')} yields no batch of "
            f"trainer.batch_size={opts.batch_size} (finite data too small?)."
        )
    if declared is None:
        check_memory(first)
    return first
