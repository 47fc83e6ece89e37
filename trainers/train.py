"""`python -m trainers.train [overrides]`: the Hydra entry point of the generic trainer.

    python -m trainers.train task=mlp optimizer=adam optimizer.learning_rate=3e-4 reduction=sum
    python -m trainers.train -m reduction=sum,mean optimizer=sgd,adam      # a sweep
    python -m trainers.train task=mlp hydra.run.dir=runs/a    # rerun it to resume from runs/a

Returns the final training loss, so optimizing sweepers can use it. Exit status (see
docs/reliability.md):

    0   finished: all trainer.steps done, or the data ran out (final checkpoint saved)
    1   a Hydra composition error (Hydra's message), or an unexpected error (traceback)
    2   bad config or input (ConfigError), an unusable or unwritable checkpoint
        (CheckpointError: disk full too), TensorBoard events unwritable (LoggerError)
    3   training went non-finite and was stopped (NonFiniteError); earlier checkpoints intact
    75  stopped by SIGTERM/SIGINT after saving a checkpoint, or during start-up before any
        step (nothing written): rerun the command to resume
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from trainers.preemption import EXIT_PREEMPTED, StopOnSignal
from trainers.preflight import EXIT_CONFIG_ERROR

log = logging.getLogger("trainers.train")

# Exit statuses (docstring above): 2 and 75 are defined next to the code that exits with them.
EXIT_NONFINITE = 3


def _hparams(cfg: DictConfig) -> dict[str, Any]:
    """The HParams entry: Hydra's group choices plus the values people sweep most."""
    from hydra.core.hydra_config import HydraConfig

    choices = {}
    if HydraConfig.initialized():
        runtime = HydraConfig.get().runtime.choices
        choices = {k: v for k, v in runtime.items() if not k.startswith("hydra/") and v is not None}
    return {
        **choices,
        "seed": cfg.seed,
        "optimizer.learning_rate": cfg.optimizer.learning_rate,
        "reduction.mode": cfg.reduction.mode,
        "trainer.batch_size": cfg.trainer.batch_size,
        "trainer.microbatches": cfg.trainer.microbatches,
        "trainer.grad_impl": cfg.trainer.grad_impl,
        "clip": cfg.clip,
    }


def build_task(cfg: DictConfig) -> Any:
    """Instantiates ``cfg.task`` after checking its ``_target_`` against the allowlist.

    The task's keys other than ``_target_`` are passed as plain values (nested ``_target_``
    nodes are not instantiated), so a config cannot make the run call anything but an
    allowed task class (``trainers.*``, ``xshard.*``, ``optax.*`` and ``allowed_targets``).

    Raises:
      ConfigError: for a missing, not allowed or unknown target, an unknown key, or a value
        the task rejects.
    """
    from xshard.config_nodes import check_kwargs, mapping, section
    from xshard.errors import ConfigError
    from xshard.targets import ALLOWED_TARGETS_KEY, allowed_prefixes, resolve_target

    kwargs = mapping(section(cfg, "task", required=True), "task")
    target = kwargs.pop("_target_", None)
    if target is None:
        raise ConfigError(
            "task._target_ is required, e.g. trainers.tasks.mlp.MLPTask; or "
            "choose an option of the 'task' group (task=mlp)."
        )
    allowed = allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))
    factory = resolve_target(target, allowed, key="task._target_")
    check_kwargs(factory, kwargs, "task", target)
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task ({target}): {e}") from e


def _check_reduction_axes(axis_name: Any, data_axes: tuple[str, ...]) -> None:
    """The trainer reduces over exactly the axes it splits the batch over.

    Reducing over fewer would leave replicas with different params; over more (a model axis)
    would sum gradients of different parameter shards.
    """
    from xshard.errors import ConfigError

    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if set(axes) != set(data_axes):
        raise ConfigError(
            f"reduction.axis_name={list(axes)} must name the data-parallel axes of the mesh, "
            f"mesh.data_axes={list(data_axes)}: the batch is split over those, so gradients "
            f"are reduced over them. Set reduction.axis_name={list(data_axes)}."
        )


def _init_distributed(node: Any) -> None:
    """``jax.distributed.initialize`` for multi-process runs (``distributed.enabled=true``).

    One process per host; on TPU pods and SLURM the arguments can stay null (JAX detects
    them). ``distributed.cpu_collectives=gloo`` joins CPU-only processes, as the tests do.
    """
    if node is None or not node.get("enabled", False):
        return
    import jax

    if node.get("cpu_collectives"):
        jax.config.update("jax_cpu_collectives_implementation", node.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=node.get("coordinator_address"),
        num_processes=node.get("num_processes"),
        process_id=node.get("process_id"),
    )


def train(cfg: DictConfig) -> float:
    """Builds everything from `cfg`, restores the latest checkpoint if any, trains.

    SIGTERM/SIGINT are handled from the start (`StopOnSignal`): a signal during start-up
    stops the run before its first step.

    Returns:
      The final training loss.

    Raises:
      ConfigError: for a bad config value, or too little disk space (before any training).
      CheckpointError: if the checkpoint to resume from is incompatible or corrupted, or a
        checkpoint cannot be written (CheckpointWriteError).
      LoggerError: if TensorBoard events cannot be written and ``logger.on_error=stop``.
      NonFiniteError: if training went non-finite beyond what the config tolerates.
      Preempted: if a signal stopped the run (after saving a checkpoint, or before any step).
    """
    with StopOnSignal() as stop:
        return _train(cfg, stop)


def _train(cfg: DictConfig, stop: StopOnSignal) -> float:
    """`train`'s body; `stop` is the run's `StopOnSignal`."""
    # ------------------------------------------------------------------ devices and mesh
    # Before any JAX computation: the simulated CPU device count is fixed at first use.
    from xshard.mesh import build_mesh, check_batch_divisible, configure_devices
    from xshard.mesh_config import data_axes as mesh_data_axes

    configure_devices(cfg.mesh)
    _init_distributed(cfg.get("distributed"))

    import jax

    from trainers.checkpoint_io import check_checkpoint_space
    from trainers.checkpointing import CheckpointHook, CheckpointOptions, run_config
    from trainers.monitor import NonFiniteMonitor, ProgressHook
    from trainers.preemption import Preempted
    from trainers.preflight import check_writable_dir
    from trainers.resume import find_resume_source, restore_checkpoint
    from trainers.tb_logger import LoggerOptions, TensorBoardHook
    from trainers.trainer import Trainer
    from xshard.errors import ConfigError
    from xshard.factory import build_optimizer

    mesh = build_mesh(cfg.mesh)
    data_axes = mesh_data_axes(cfg.mesh)
    check_batch_divisible(cfg.trainer.batch_size, mesh, data_axes)
    num_steps = cfg.trainer.steps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
        raise ConfigError(f"trainer.steps={num_steps!r}: expected a positive number of steps.")

    # ------------------------------------------------------------------ outputs
    if logging.getLogger("absl").level == logging.NOTSET:  # Orbax logs every save at INFO
        logging.getLogger("absl").setLevel(logging.WARNING)
    ckpt = CheckpointOptions.from_config(cfg.checkpoint)
    logger_opts = LoggerOptions.from_config(cfg.logger)
    if jax.process_index() == 0:  # the only process that writes TensorBoard events
        check_writable_dir(cfg.paths.tb_dir, "paths.tb_dir")
    if ckpt.enabled:
        check_writable_dir(cfg.paths.checkpoint_dir, "paths.checkpoint_dir")
    # The run's own checkpoints first (a rerun resumes), else trainer.resume_from.
    source = find_resume_source(cfg.paths.checkpoint_dir, cfg.trainer.resume_from)

    # ------------------------------------------------------------------ task and optimizer
    task = build_task(cfg)
    tx = build_optimizer(cfg, mesh=mesh)
    monitor = NonFiniteMonitor(
        skip_nonfinite=bool(cfg.reduction.get("skip_nonfinite", False)),
        max_consecutive=cfg.trainer.max_consecutive_nonfinite,
    )
    _check_reduction_axes(cfg.reduction.get("axis_name", "data"), data_axes)
    trainer = Trainer(  # validates trainer.* (ConfigError)
        task,
        tx,
        mesh,
        data_axes=data_axes,
        global_batch_size=cfg.trainer.batch_size,
        microbatches=cfg.trainer.microbatches,
        grad_impl=cfg.trainer.grad_impl,
        reduction=cfg.reduction.mode,
        seed=cfg.seed,
    )

    # ------------------------------------------------------------------ state: new or restored
    def batches(start_step: int):
        return task.batches(
            cfg.trainer.batch_size,
            seed=cfg.seed,
            start_step=start_step,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    first = next(iter(batches(0)), None)
    if first is None:
        raise ConfigError(
            f"task={cfg.task.get('name', 'task')} yields no batch of "
            f"trainer.batch_size={cfg.trainer.batch_size} (finite data too small?)."
        )
    state = trainer.init(trainer.init_params(first))
    if ckpt.enabled:  # a full disk fails here, not at the first save
        check_checkpoint_space(cfg.paths.checkpoint_dir, state)
    config = run_config(cfg)
    # The step restores the RNG and the data position too: both are pure functions of it.
    if source is not None:
        state = restore_checkpoint(
            source, state, config, fallback_to_previous=ckpt.fallback_to_previous
        )
    start_step = int(jax.device_get(state.step))
    if stop():  # a signal during start-up: stop before writing anything
        raise stop.stopped_during_start_up(start_step)

    # ------------------------------------------------------------------ hooks
    lead = jax.process_index() == 0  # logs and the progress bar come from one process
    hooks = [monitor]  # first: a bad step raises before any other hook sees it
    if lead:
        hooks.append(
            TensorBoardHook(
                cfg.paths.tb_dir,
                log_every=cfg.trainer.log_every,
                global_batch_size=cfg.trainer.batch_size,
                num_steps=num_steps,
                hparams=_hparams(cfg),
                config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                flush_secs=logger_opts.flush_secs,
                on_error=logger_opts.on_error,
            )
        )
    hooks.append(
        ProgressHook(
            start_step=start_step, num_steps=num_steps, enabled=cfg.trainer.progress and lead
        )
    )
    if ckpt.enabled:  # created after the restore: its manager prunes old steps when saving
        hooks.append(CheckpointHook(cfg.paths.checkpoint_dir, ckpt, config))

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
        layer_stats_every=cfg.trainer.layer_stats_every,
        histogram_every=cfg.trainer.histogram_every,
        stats_every=cfg.trainer.stats_every,
        should_stop=stop,
    )
    step = int(jax.device_get(state.step))
    if stop() and step == start_step < num_steps:  # the signal came before the first step
        raise stop.stopped_during_start_up(start_step)
    final = monitor.last_loss
    log.info("Finished (%s) at step %d, final loss %.5f.", reason, step, final)
    log.info(
        "TensorBoard logs: %s  (view: tensorboard --logdir %s)", cfg.paths.tb_dir, cfg.paths.tb_dir
    )
    saved = (
        f"checkpoint saved in {cfg.paths.checkpoint_dir}/{step}"
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
    if stop() and step < num_steps:
        raise Preempted(
            f"Stopped by {stop.signal_name} at step {step} of {num_steps}; {saved}. Rerun the "
            "same command (same hydra.run.dir) to resume from the latest checkpoint."
        )
    return final


def _exit(error: BaseException, code: int, label: str = "error") -> None:
    """Reports `error` in one line (log file and stderr) and exits with `code`."""
    log.log(logging.WARNING if code == EXIT_PREEMPTED else logging.ERROR, "%s", error)
    print(f"xshard: {label}: {error}", file=sys.stderr)
    sys.exit(code)


@hydra.main(config_path="pkg://xshard.conf", config_name="xshard_train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Hydra main: trains and returns the final loss, or exits with a documented status."""
    from trainers.checkpointing import CheckpointError
    from trainers.monitor import NonFiniteError
    from trainers.preemption import Preempted
    from trainers.tb_logger import LoggerError
    from xshard.errors import ConfigError

    try:
        return train(cfg)
    except Preempted as e:
        _exit(e, EXIT_PREEMPTED, label="preempted")
    except NonFiniteError as e:
        _exit(e, EXIT_NONFINITE)
    except (ConfigError, CheckpointError, LoggerError) as e:  # name the key, value, what's allowed
        _exit(e, EXIT_CONFIG_ERROR)


if __name__ == "__main__":
    main()
