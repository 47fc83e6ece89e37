"""`train(cfg)`: a run from its composed config to its final loss, one section a function.

    options -> join the cluster, build the mesh (`place`)
            -> claim and check the run's dirs, find what to resume from (`prepare_dirs`)
            -> build the task, optimizer and trainer (`trainers.app.builders.build_run`)
            -> the first batch, a new state, the evaluator (`trainers.app.warm_up`)
            -> a restored state, or a live peer's for an elastic group (`start`)
            -> the gradient path, with ``trainer.grad_impl=auto`` (`trainers.app.grad_path`)
            -> the hooks (`run_hooks`) -> `Trainer.fit` -> how it ended (`check_end`)

Every check a process can fail alone runs under `Cluster.agreed`, so that no process waits for
a failed one. Stop signals are handled from the start (`StopOnSignal`): a signal during
start-up stops the run before its first step. An elastic group's warm standby
(``elastic.standby=true``, `trainers.cluster.standby`) warms up and compiles first, then
waits for its supervisor's go before it claims the run's dirs and starts its manager.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from trainers.app.builders import RunOptions, RunParts, build_run, read_options
from trainers.app.grad_path import choose_path
from trainers.app.stages import Placement, Started
from trainers.app.warm_up import Warm, batches, warm_up
from trainers.app.wiring import run_hooks
from trainers.cluster.multihost import current, join_cluster
from trainers.cluster.preemption import StopOnSignal, stop_signals
from trainers.hooks.summary import RunSummary

if TYPE_CHECKING:
    from trainers.app.elastic_group import ElasticGroup
    from trainers.core.loop import FitResult

log = logging.getLogger("trainers.train")


def train(cfg: DictConfig, summary: RunSummary | None = None) -> float:
    """Builds everything from `cfg`, restores the latest checkpoint if any, trains.

    With several processes (``distributed.enabled=true``) they agree on every stop and
    start-up failure, and a lost process ends the others (`trainers.cluster.multihost`).

    Args:
      cfg: the composed config.
      summary: records what the run did (a new one if None), also when it fails.

    Returns:
      The final training loss.

    Raises:
      ConfigError: for a bad config value, or too little disk space (before any training).
      CheckpointError: if the checkpoint to resume from is incompatible or corrupted, or a
        checkpoint cannot be written (CheckpointWriteError).
      LoggerError: if TensorBoard events cannot be written and ``logger.on_error=stop``.
      NonFiniteError: if training went non-finite beyond what the config tolerates.
      Preempted: if a signal stopped the run (after saving a checkpoint, or before any step).
      PeerError: if another process failed at a step every process must pass.
    """
    from trainers.app.population_run import trial_stop

    options = read_options(cfg)  # as trainers.doctor checks them
    with trial_stop() or StopOnSignal(stop_signals(options.trainer.stop_signals)) as stop:
        loss = _train(cfg, options, stop, summary or RunSummary())
    current().announce_exit(0)  # the other processes stop watching this one
    return loss


def _train(cfg: DictConfig, options: RunOptions, stop: StopOnSignal, summary: RunSummary) -> float:
    """`train`'s sections in order; `stop` is the run's `StopOnSignal`. An elastic group's
    warm standby (`trainers.cluster.standby`) builds, warms up and compiles before it claims
    the run dir and starts its manager, when its supervisor says go."""
    from trainers.app.elastic_group import group_run, open_group, standby_of
    from trainers.core.compile_cache import enable_compilation_cache
    from trainers.rundir.user_paths import launch_dir, user_path

    # Before the first compilation: every job of a sweep, every rerun reads what was compiled.
    cache_dir = options.trainer.compilation_cache_dir  # where the user typed it, not the run dir
    cache = enable_compilation_cache(
        None if cache_dir is None else user_path(cache_dir, launch_dir())
    )
    summary.use_compilation_cache(cache)
    standby = standby_of(cfg)
    # A standby's error before its go ends it without writing to its group's run dir.
    with contextlib.nullcontext() if standby is None else standby.before_go():
        where = place(cfg, options)
        source = None if standby is not None else prepare_dirs(where, options)
        parts = build_run(cfg, options, where.mesh, where.data_axes)  # as trainers.doctor does
        options, parts = group_run(cfg, options, parts)  # an elastic group's data, one path
        # a standby: everything but the run dir, the manager and the join, before its go
        warm = None if standby is None else warm_up(cfg, options, where, parts)
        if standby is not None and warm is not None:
            standby.compile(parts.trainer, warm.state, warm.first, options.trainer)
    if standby is not None:
        standby.take_over(where.dirs.output_dir)
        source = prepare_dirs(where, options)
    with open_group(cfg, parts, stop) as group:  # an elastic replica group (else None)
        started = start(cfg, options, where, parts, source, stop, group, warm)
        parts, started = choose_path(options, where, parts, started, started.source, summary, cache)
        return _fit(cfg, options, where, parts, started, stop, summary)


def _fit(
    cfg: DictConfig,
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    stop: StopOnSignal,
    summary: RunSummary,
) -> float:
    """`train`'s last sections: the hooks, the fit, how it ended; the final loss."""
    from trainers.hooks.monitor import NonFiniteMonitor

    monitor = NonFiniteMonitor(
        skip_nonfinite=parts.spec.skip_nonfinite,
        max_consecutive=options.trainer.max_consecutive_nonfinite,
    )
    hooks = run_hooks(cfg, options, where, parts, started, summary, monitor, stop)
    opts = options.trainer
    log.info(
        "Training %s for %d steps on mesh %s (data axes %s), from step %d.",
        cfg.task.get("name", "task"),
        opts.steps,
        dict(where.mesh.shape),
        where.data_axes,
        started.start_step,
    )
    result = parts.trainer.fit(
        started.state,
        started.data,
        num_steps=opts.steps,
        hooks=hooks,
        should_stop=stop,
        **opts.stat_periods,
    )
    own_stop = any(h.wants_stop() for h in hooks)  # early stopping decides alike everywhere
    check_end(result, options, where, started.start_step, stop, own_stop)
    return monitor.last_loss


# ------------------------------------------------------------------ processes, devices, mesh


def place(cfg: DictConfig, options: RunOptions) -> Placement:
    """Joins the other processes, shares their dirs, checks they run one config, builds the mesh.

    Before any JAX computation: the simulated CPU device count is fixed at first use.
    """
    from trainers.app.allowlist import log_active_prefixes
    from trainers.app.hydra_run import rewrite_config_dump
    from trainers.cluster.run_dirs import share_run_dirs
    from trainers.cluster.same_config import check_same_config
    from trainers.config.plain import flat_config
    from xshard.mesh.build import build_mesh, check_batch_divisible, configure_devices
    from xshard.mesh.spec import data_axes as mesh_data_axes

    cluster = join_cluster(options.distributed)
    dirs = share_run_dirs(options.paths, cluster)  # process 0's dirs; only it keeps train.log
    if dirs.output_shared:  # the config dump in the run dir is process 0's
        rewrite_config_dump(cfg)
    if cluster.watchdog is not None:  # a lost process is reported with the last checkpoint
        cluster.watchdog.name_checkpoints(dirs.checkpoint_dir)
    check_same_config(cluster, flat_config(cfg))  # every process, the same config: else exit 2
    log_active_prefixes(cfg)
    configure_devices(cfg.mesh, num_processes=cluster.count)
    mesh = build_mesh(cfg.mesh)
    data_axes = mesh_data_axes(cfg.mesh)
    check_batch_divisible(options.trainer.batch_size, mesh, data_axes)
    return Placement(cluster, dirs, mesh, data_axes)


# ------------------------------------------------------------------ outputs


def prepare_dirs(where: Placement, options: RunOptions) -> Any:
    """Checks and claims the run's dirs; returns the checkpoint to resume from (or None).

    A run dir copied or moved from elsewhere is untrusted: before the run creates, locks or
    writes anything, a path it writes that a link leads out of it is refused (exit 2).
    """
    from trainers.app.hydra_run import hydra_dirs
    from trainers.app.loggers import logger_outputs
    from trainers.app.population_run import agreed_source
    from trainers.checkpoint.owner import claim_checkpoint_dir
    from trainers.checkpoint.resume import find_resume_source
    from trainers.cluster.run_dirs import check_same_checkpoints, check_shared_dir
    from trainers.rundir.disk import check_writable_dir
    from trainers.rundir.links import check_run_dirs

    if logging.getLogger("absl").level == logging.NOTSET:  # Orbax logs every save at INFO
        logging.getLogger("absl").setLevel(logging.WARNING)
    cluster, dirs, ckpt = where.cluster, where.dirs, options.checkpoint
    hydra_subdir, sweep_dir = hydra_dirs()
    with cluster.agreed("checking the run dir for links"):
        check_run_dirs(
            dirs.output_dir,
            dirs.checkpoint_dir,
            dirs.tb_dir,
            lead=cluster.lead,
            outputs=logger_outputs(options),
            hydra_subdir=hydra_subdir,
            sweep_dir=sweep_dir,
        )
    with cluster.agreed("checking the output dirs"):
        if cluster.lead:  # the only process that writes TensorBoard events
            check_writable_dir(dirs.tb_dir, "paths.tb_dir")
        # One run per checkpoint dir: process 0 refuses another run's dir or one in use, then
        # holds its lock until the process ends (so only this run's checkpoints are pruned).
        claim_checkpoint_dir(
            dirs.checkpoint_dir, dirs.lead_output_dir, lead=cluster.lead, create=ckpt.enabled
        )
        if ckpt.enabled and cluster.lead:
            check_writable_dir(dirs.checkpoint_dir, "paths.checkpoint_dir")
    if ckpt.enabled:  # every process writes its shards there: the same dir for all
        check_shared_dir(cluster, dirs.checkpoint_dir, "paths.checkpoint_dir", dirs.output_dir)
    # The run's own checkpoints first (a rerun resumes), else trainer.resume_from.
    with cluster.agreed("finding the checkpoint to resume from"):
        source = agreed_source(find_resume_source(dirs.checkpoint_dir, options.trainer.resume_from))
    check_same_checkpoints(cluster, source)
    return source


# ------------------------------------------------------------------ state: new or restored


def start(
    cfg: DictConfig,
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    source: Any,
    stop: StopOnSignal,
    group: ElasticGroup | None = None,
    warm: Warm | None = None,
) -> Started:
    """The state to train from (new, or restored from `source`; an elastic `group`'s from a
    live peer when it is behind them) and the run's evaluator; `warm` if warmed up already.

    Raises:
      ConfigError: if the data yields no batch, or the disk has no room for a checkpoint.
      Preempted: if a stop signal reached any process during start-up.
    """
    import jax

    from trainers.checkpoint.data_state import is_checkpointable, restore_data_state
    from trainers.checkpoint.io import check_checkpoint_space
    from trainers.checkpoint.resume import restore_checkpoint
    from trainers.config.plain import run_config

    trainer, cluster = parts.trainer, where.cluster
    first, state, evaluator = warm or warm_up(cfg, options, where, parts)
    if options.checkpoint.enabled:  # a full disk fails here, not at the first save
        with cluster.agreed("checking the free space for checkpoints"):
            check_checkpoint_space(where.dirs.checkpoint_dir, state)
    config = run_config(cfg)
    # The step restores the RNG and the data position too: both are pure functions of it.
    restored = None
    if source is not None:
        fallback = options.checkpoint.fallback_to_previous
        state = restore_checkpoint(source, state, config, fallback_to_previous=fallback)
        state = trainer.row_order(state)  # checkpoints hold Muon's momentum in row order
        restored = int(jax.device_get(state.step))
    if group is not None:  # healed from a peer: its step, the data a function of it
        state = group.join(state, trainer, first, options.trainer)
    start_step = int(jax.device_get(state.step))
    source = source if restored == start_step else None  # else: a peer's step, not its own
    data = batches(options, parts, start_step)
    if source is not None and is_checkpointable(data):  # a stream: its saved position
        restore_data_state(source.directory / str(start_step), data)
    check_start_up_stop(where, stop, start_step)
    return Started(state, start_step, data, evaluator, config, first, source)


def check_start_up_stop(where: Placement, stop: StopOnSignal, start_step: int) -> None:
    """Stops the run before it writes anything if a stop signal reached any process during
    start-up.

    Raises:
      Preempted: naming the signal and, with several processes, the one that received it.
    """
    cluster = where.cluster
    signals = cluster.all_gather("start_up_stop", stop.signal_name)
    if any(signals):
        by = next(i for i, name in enumerate(signals) if name)
        raise stop.stopped_during_start_up(
            start_step, by=None if cluster.count == 1 else cluster.name(by), signal_name=signals[by]
        )


# ------------------------------------------------------------------ how the run ended


def check_end(
    result: FitResult,
    options: RunOptions,
    where: Placement,
    start_step: int,
    stop: StopOnSignal,
    own_stop: bool = False,
) -> None:
    """Says how `Trainer.fit` ended (its `result`): a clean end returns; a stop raises.

    `own_stop`: whether a hook of this process asked to stop too (early stopping, whose
    decision every process makes alike): then another process's vote is no peer's failure.

    Raises:
      Preempted: a stop signal, here or to another process, before the last step.
      PeerError: another process's hook stopped the run.
    """
    import jax

    from trainers.exits import PeerError, Preempted

    num_steps, ckpt, cluster = options.trainer.steps, options.checkpoint, where.cluster
    state, reason = result.state, result.reason
    step = int(jax.device_get(state.step))
    if stop() and step == start_step < num_steps:  # the signal came before the first step
        raise stop.stopped_during_start_up(start_step)
    saved = (
        f"checkpoint saved in {where.dirs.checkpoint_dir}/{step}"
        if ckpt.enabled
        else "no checkpoint written (checkpoint.enabled=false)"
    )
    if reason == "data_exhausted":
        log.warning(
            "The data ran out after step %d of trainer.steps=%d: ended cleanly, %s.",
            step,
            num_steps,
            saved,
        )
    agreed = result.agreed_stop  # multi-process: whose vote stopped the run
    by_peer = reason == "stopped" and agreed is not None and agreed.signal
    if step < num_steps and (stop() or by_peer):
        peer = None if agreed is None else cluster.name(agreed.process)  # by_peer: not None
        by = stop.signal_name if stop() else f"a stop signal to {peer}"
        raise Preempted(
            f"Stopped by {by} at step {step} of {num_steps}; {saved}. Rerun the same command "
            "(same hydra.run.dir, every process) to resume from the latest checkpoint."
        )
    if (
        reason == "stopped"
        and step < num_steps
        and agreed
        and agreed.process != cluster.index
        and not own_stop
    ):
        raise PeerError(
            f"Stopped at step {step} of {num_steps} because a hook of "
            f"{cluster.name(agreed.process)} asked to (see its log); {saved}."
        )
