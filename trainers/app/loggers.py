"""The run's loggers (``logger=[...]``), built from the config: one
`trainers.hooks.run_logger.LoggerHook` hands the same scalars (`trainers.hooks.logged_scalars`),
the resolved config, the hyperparameters of TensorBoard's HParams and the run's summary to
every selected sink (TensorBoard, W&B, MLflow, CSV). Only the lead process logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainers.app.builders import RunOptions, RunParts
from trainers.app.stages import Placement, Started
from trainers.hooks.summary import RunSummary


def _scalar_options(options: RunOptions, parts: RunParts, mesh: Any, params: Any) -> Any:
    """What the run's logged scalars are derived with (`trainers.hooks.logged_scalars`)."""
    import jax
    import numpy as np

    from trainers.hooks.logged_scalars import ScalarOptions
    from trainers.hooks.perf import run_step_flops
    from trainers.tasks.base import tokens_per_example
    from xshard.reduce.compressed import tree_size

    opts, logger_opts, trainer = options.trainer, options.logger, parts.trainer
    itemsize = np.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    traffic = parts.spec.mode_bytes_per_step(dict(mesh.shape), tree_size(params), itemsize)
    return ScalarOptions(
        log_every=opts.log_every,
        num_steps=opts.steps,
        global_batch_size=opts.batch_size,
        noise_ema_steps=logger_opts.noise_ema_steps,
        tokens_per_example=tokens_per_example(parts.task),
        num_devices=mesh.size,
        peak_flops_per_device=logger_opts.peak_flops_per_device,
        step_flops=lambda: run_step_flops(trainer),
        compile_seconds=lambda: trainer.compile_seconds,
        periodic_axis=None if trainer.periodic is None else trainer.periodic.axis,
        traffic=traffic,
    )


def logger_hook(
    cfg: DictConfig,
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    summary: RunSummary,
) -> Any:
    """The lead process's `LoggerHook` over the selected loggers; None when there is none."""
    from trainers.config.cli_args import run_overrides
    from trainers.core.periodic import outer_params
    from trainers.hooks.hparams import hparams
    from trainers.hooks.logged_scalars import LoggedScalars
    from trainers.hooks.run_logger import LoggerHook, RunInfo
    from trainers.hooks.tensorboard import TensorBoardSink

    logger_opts = options.logger
    sinks: list[Any] = []
    if logger_opts.tensorboard is not None:
        sinks.append(TensorBoardSink(where.dirs.tb_dir, flush_secs=logger_opts.flush_secs))
    sinks += _run_loggers(options)
    if not sinks:
        return None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    config = {str(k): v for k, v in resolved.items()}
    values, overridden = hparams(started.config, run_overrides())
    run = RunInfo(
        name=Path(options.paths.tb_dir).name,
        config=config,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        hparams=dict(values),
        overridden=overridden,
        eval_metrics=started.evaluator.metric_names if started.evaluator else (),
    )
    one_replica = outer_params(started.state)  # a periodic run's params have a replica axis
    scalars = LoggedScalars(_scalar_options(options, parts, where.mesh, one_replica))
    return LoggerHook(sinks, run, scalars, summary, on_error=logger_opts.on_error)


def logger_outputs(options: RunOptions) -> Any:
    """What the selected W&B, MLflow and CSV loggers write (`trainers.rundir.outputs.Outputs`),
    for the start-up check of the run dir (`trainers.rundir.links.check_run_dirs`)."""
    from trainers.rundir.outputs import merged

    return merged(logger.outputs() for logger in _run_loggers(options))


def _run_loggers(options: RunOptions) -> list[Any]:
    """The selected W&B, MLflow and CSV loggers' sinks, in the group's order."""
    opts = options.logger
    out: list[Any] = []
    if opts.wandb is not None:
        from trainers.hooks.wandb_logger import WandbSink

        out.append(WandbSink(opts.wandb))
    if opts.mlflow is not None:
        from trainers.hooks.mlflow_logger import MlflowSink

        out.append(MlflowSink(opts.mlflow))
    if opts.csv is not None:
        from trainers.hooks.csv_logger import CsvSink

        out.append(CsvSink(opts.csv.path))
    return out
