"""`python -m trainers.train [overrides]`: the Hydra entry point of the generic trainer.

    python -m trainers.train task=mlp optimizer=adam optimizer.learning_rate=3e-4 reduction=sum
    python -m trainers.train -m reduction=sum,mean optimizer=sgd,adam      # a sweep
    python -m trainers.train task=mlp hydra.run.dir=runs/a    # rerun it to resume from runs/a

Returns ``trainer.objective`` (the final training loss, or e.g. ``eval/loss`` of the final
evaluation), so optimizing sweepers can use it. Every run ends with a summary (steps, skipped
steps, final and best loss, evaluation, the checkpoint) and writes it to
``<output dir>/result.json``. Your own ``@hydra.main`` keeps all of this by calling
`trainers.run` (`trainers.entry`).

Exit status of a single run (see docs/reliability.md):

    0   finished: all trainer.steps done, or the data ran out (final checkpoint saved)
    1   a Hydra composition error (Hydra's message), or an unexpected error (traceback)
    2   bad config or input (ConfigError; a config group given no option name, such as
        schedule=null, too), an unusable or unwritable checkpoint (CheckpointError: disk full
        too), TensorBoard events unwritable (LoggerError)
    3   training went non-finite and was stopped (NonFiniteError); checkpoints written before
        stay valid (the run summary names the latest one, or says there is none)
    4   multi-process runs: another process was lost (killed, crashed, unreachable, or failed
        on its own); the last complete checkpoint is valid: restart every process to resume
    75  stopped by a signal of trainer.stop_signals (SIGTERM, SIGINT, SIGUSR2) after saving a
        checkpoint, or during start-up before any step (nothing written): rerun the command
        to resume. With several processes, a signal to any one stops all after the same step.

In a multirun (``-m``) a job that fails or diverges does not exit: it is recorded and the sweep
goes on (`trainers.sweep`, docs/sweeps.md); a signal still stops the sweep (75).
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all, before JAX is imported (trainers.signal_latch)
    from trainers import signal_latch

    signal_latch.install()

import logging

from omegaconf import DictConfig, OmegaConf

from trainers.app_main import main as xshard_main
from trainers.cli_help import register_help_resolver
from trainers.cli_overrides import check_group_overrides
from trainers.entry import run
from trainers.multihost import current, join_cluster
from trainers.preemption import EXIT_PREEMPTED, StopOnSignal, stop_signals
from trainers.preflight import EXIT_CONFIG_ERROR
from trainers.setup import build_run, read_options
from trainers.summary import RunSummary
from xshard.config.resolvers import register_resolvers

register_resolvers()  # paths.tb_dir's; also in processes Hydra's plugin scan did not set up
register_help_resolver()

log = logging.getLogger("trainers.train")

# Exit statuses (docstring above): 2 and 75 are defined next to the code that exits with them.
EXIT_NONFINITE = 3
__all__ = ["EXIT_CONFIG_ERROR", "EXIT_NONFINITE", "EXIT_PREEMPTED", "main", "run", "train"]


def train(cfg: DictConfig, summary: RunSummary | None = None) -> float:
    """Builds everything from `cfg`, restores the latest checkpoint if any, trains.

    The signals of ``trainer.stop_signals`` are handled from the start (`StopOnSignal`): a
    signal during start-up stops the run before its first step. With several processes
    (``distributed.enabled=true``) they agree on every stop and start-up failure, and a lost
    process ends the others (`trainers.multihost`, docs/multihost.md).

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
    with StopOnSignal(stop_signals(cfg)) as stop:
        loss = _train(cfg, stop, summary or RunSummary())
    current().announce_exit(0)  # the other processes stop watching this one
    return loss


def _train(cfg: DictConfig, stop: StopOnSignal, summary: RunSummary) -> float:
    """`train`'s body; `stop` is the run's `StopOnSignal`."""
    from trainers.allowlist import log_active_prefixes

    # ------------------------------------------------------------------ the run's own keys
    options = read_options(cfg)  # as trainers.doctor checks them
    seed, opts, dist = options.seed, options.trainer, options.distributed

    # ------------------------------------------------------------------ processes, devices, mesh
    # Before any JAX computation: the simulated CPU device count is fixed at first use.
    from trainers.run_dirs import check_same_checkpoints, check_shared_dir, share_run_dirs
    from trainers.same_config import check_same_config
    from xshard.mesh import (
        build_mesh,
        check_batch_divisible,
        configure_devices,
        data_parallel_size,
    )
    from xshard.mesh_config import data_axes as mesh_data_axes

    cluster = join_cluster(dist)
    dirs = share_run_dirs(cfg, cluster)  # process 0's dirs; only it keeps train.log
    check_same_config(cluster, cfg)  # every process, the same config: else all exit 2
    log_active_prefixes(cfg)
    configure_devices(cfg.mesh, num_processes=cluster.count)

    import jax

    from trainers.checkpoint_io import check_checkpoint_space
    from trainers.checkpointing import CheckpointHook, run_config
    from trainers.ckpt_owner import claim_checkpoint_dir
    from trainers.evaluation import EvalHook, build_evaluator
    from trainers.hparams import hparams
    from trainers.monitor import NonFiniteMonitor, ProgressHook
    from trainers.multihost import PeerError
    from trainers.perf import ProfileHook, step_flops
    from trainers.preemption import Preempted
    from trainers.preflight import check_batch_fits, check_writable_dir
    from trainers.resume import find_resume_source, restore_checkpoint
    from trainers.tasks.base import tokens_per_example
    from trainers.tb_logger import TensorBoardHook
    from trainers.zero import state_report
    from xshard.errors import ConfigError

    mesh = build_mesh(cfg.mesh)
    data_axes = mesh_data_axes(cfg.mesh)
    check_batch_divisible(opts.batch_size, mesh, data_axes)
    num_steps = opts.steps

    # ------------------------------------------------------------------ outputs
    if logging.getLogger("absl").level == logging.NOTSET:  # Orbax logs every save at INFO
        logging.getLogger("absl").setLevel(logging.WARNING)
    ckpt, logger_opts = options.checkpoint, options.logger

    # A run dir copied or moved from elsewhere is untrusted: before the run creates, locks or
    # writes anything, refuse a path it writes that a link leads out of it (exit 2, one line).
    from trainers.run_dir_links import check_run_dirs

    with cluster.agreed("checking the run dir for links"):
        check_run_dirs(dirs.output_dir, dirs.checkpoint_dir, dirs.tb_dir, lead=cluster.lead)

    # An error on one process is raised on all (`agreed`): none waits for a failed one.
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
        source = find_resume_source(dirs.checkpoint_dir, opts.resume_from)
    check_same_checkpoints(cluster, source)

    # ------------------------------------------------------------------ task and optimizer
    parts = build_run(cfg, options, mesh, data_axes)  # as trainers.doctor builds them
    task, user_hooks, trainer, spec = parts.task, parts.hooks, parts.trainer, parts.spec
    monitor = NonFiniteMonitor(
        skip_nonfinite=spec.skip_nonfinite,
        max_consecutive=opts.max_consecutive_nonfinite,
    )

    # ------------------------------------------------------------------ state: new or restored
    def batches(start_step: int):
        return task.batches(
            opts.batch_size,
            seed=seed,
            start_step=start_step,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    check_batch_fits(
        lambda size: task.batches(size, seed=seed, process_count=jax.process_count()),
        opts.batch_size,
        probe_batch=data_parallel_size(mesh, data_axes),
        process_count=jax.process_count(),
    )
    first = next(iter(batches(0)), None)
    if first is None:
        raise ConfigError(
            f"task={cfg.task.get('name', 'task')} yields no batch of "
            f"trainer.batch_size={opts.batch_size} (finite data too small?)."
        )
    state = trainer.init(*trainer.init_variables(first))
    if cluster.lead:
        log.info("%s", state_report(trainer.layout, state))
    if ckpt.enabled:  # a full disk fails here, not at the first save
        with cluster.agreed("checking the free space for checkpoints"):
            check_checkpoint_space(dirs.checkpoint_dir, state)
    config = run_config(cfg)
    # The step restores the RNG and the data position too: both are pure functions of it.
    if source is not None:
        state = restore_checkpoint(
            source, state, config, fallback_to_previous=ckpt.fallback_to_previous
        )
    start_step = int(jax.device_get(state.step))
    signals = cluster.all_gather("start_up_stop", stop.signal_name)
    if any(signals):  # a signal during start-up, to any process: stop before writing anything
        by = next(i for i, name in enumerate(signals) if name)
        raise stop.stopped_during_start_up(
            start_step, by=None if cluster.count == 1 else cluster.name(by), signal_name=signals[by]
        )

    # Compiled now: a bad eval split or trainer.objective fails before training.
    evaluator = build_evaluator(task, mesh, state, data_axes=data_axes, opts=opts, seed=seed)

    # ------------------------------------------------------------------ hooks
    summary.begin(
        num_steps=num_steps,
        start_step=start_step,
        checkpoint_dir=dirs.checkpoint_dir if ckpt.enabled else None,
        objective=opts.objective,
    )
    lead = cluster.lead  # logs and the progress bar come from one process
    # The monitor comes before the hooks that act on a step: a bad step raises before they
    # see it. The summary only records, so it sees the step that diverged too.
    hooks = [summary, monitor]
    eval_sinks = [summary.on_eval]
    tb_hook = None
    if lead:
        values, overridden = hparams(cfg)
        tb_hook = TensorBoardHook(
            dirs.tb_dir,
            log_every=opts.log_every,
            global_batch_size=opts.batch_size,
            num_steps=num_steps,
            hparams=values,
            overridden=overridden,
            config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
            flush_secs=logger_opts.flush_secs,
            on_error=logger_opts.on_error,
            noise_ema_steps=logger_opts.noise_ema_steps,
            tokens_per_example=tokens_per_example(task),
            step_flops=lambda: step_flops(trainer.compiled),
            num_devices=mesh.size,
            peak_flops_per_device=logger_opts.peak_flops_per_device,
            best_loss=lambda: (summary.best_loss, summary.best_step),
            eval_metrics=evaluator.metric_names if evaluator else (),
            eval_results=summary.eval_results,
        )
        eval_sinks.append(tb_hook.on_eval)
    if evaluator is not None:  # before TensorBoard's hook: its on_end may evaluate
        hooks.append(
            EvalHook(evaluator, every=opts.eval_every, num_steps=num_steps, sinks=eval_sinks)
        )
    if lead:
        hooks.append(tb_hook)
        if opts.profile_steps is not None:
            hooks.append(ProfileHook(dirs.tb_dir, *opts.profile_steps, start_step=start_step))
    hooks.append(
        ProgressHook(start_step=start_step, num_steps=num_steps, enabled=opts.progress and lead)
    )
    if ckpt.enabled:  # created after the restore: its manager prunes old steps when saving
        checkpoints = CheckpointHook(dirs.checkpoint_dir, ckpt, config)
        checkpoints.prepare(state)  # compiles its check now, not during the first save
        hooks.append(checkpoints)

    hooks += user_hooks  # after the built-in ones

    # ------------------------------------------------------------------ train
    log.info(
        "Training %s for %d steps on mesh %s (data axes %s), from step %d.",
        cfg.task.get("name", "task"),
        num_steps,
        dict(mesh.shape),
        data_axes,
        start_step,
    )
    state, reason = trainer.fit(
        state,
        batches(start_step),
        num_steps=num_steps,
        hooks=hooks,
        layer_stats_every=opts.layer_stats_every,
        histogram_every=opts.histogram_every,
        stats_every=opts.stats_every,
        should_stop=stop,
    )
    step = int(jax.device_get(state.step))
    if stop() and step == start_step < num_steps:  # the signal came before the first step
        raise stop.stopped_during_start_up(start_step)
    final = monitor.last_loss
    saved = (
        f"checkpoint saved in {dirs.checkpoint_dir}/{step}"
        if ckpt.enabled
        else ("no checkpoint written (checkpoint.enabled=false)")
    )
    if reason == "data_exhausted":
        log.warning(
            "The data ran out after step %d of trainer.steps=%d: ended cleanly, %s.",
            step,
            num_steps,
            saved,
        )
    agreed = trainer.agreed_stop  # multi-process: whose vote stopped the run
    by_peer = reason == "stopped" and agreed is not None and agreed.signal
    if step < num_steps and (stop() or by_peer):
        by = stop.signal_name if stop() else f"a stop signal to {cluster.name(agreed.process)}"
        raise Preempted(
            f"Stopped by {by} at step {step} of {num_steps}; {saved}. Rerun the same command "
            "(same hydra.run.dir, every process) to resume from the latest checkpoint."
        )
    if reason == "stopped" and step < num_steps and agreed and agreed.process != cluster.index:
        raise PeerError(
            f"Stopped at step {step} of {num_steps} because a hook of "
            f"{cluster.name(agreed.process)} asked to (see its log); {saved}."
        )
    return final


@xshard_main(config_path="pkg://xshard.conf", config_name="xshard_train")
def main(cfg: DictConfig) -> float | None:
    """Hydra main of ``python -m trainers.train``: `trainers.entry.run` on the composed config."""
    return run(cfg)


if __name__ == "__main__":
    check_group_overrides()  # schedule=null: one line and exit 2, not Hydra's traceback
    main()
