"""The run's W&B, MLflow and CSV loggers (``logger=[...]``), built from the config.

TensorBoard's hook is `tensorboard_hook` (with the run's HParams); the others are one
`trainers.hooks.run_logger.LoggerHook` each, around the logger of their option, with the same
scalars (`trainers.hooks.logged_scalars`), the resolved config, the hyperparameters of
TensorBoard's HParams and the run's summary. Only the lead process logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainers.app.build import RunOptions, RunParts
from trainers.app.stages import Placement, Started
from trainers.hooks.summary import RunSummary


def logged_scalars(options: RunOptions, parts: RunParts, num_devices: int) -> Any:
    """A new `LoggedScalars` for the run (every logger keeps its own moving averages)."""
    from trainers.hooks.logged_scalars import LoggedScalars
    from trainers.hooks.perf import step_flops
    from trainers.tasks.base import tokens_per_example

    opts, logger_opts, trainer = options.trainer, options.logger, parts.trainer
    return LoggedScalars(
        log_every=opts.log_every,
        num_steps=opts.steps,
        global_batch_size=opts.batch_size,
        noise_ema_steps=logger_opts.noise_ema_steps,
        tokens_per_example=tokens_per_example(parts.task),
        step_flops=lambda: step_flops(trainer.compiled),
        compile_seconds=lambda: trainer.compile_seconds,
        num_devices=num_devices,
        peak_flops_per_device=logger_opts.peak_flops_per_device,
    )


def logger_hooks(
    cfg: DictConfig, options: RunOptions, parts: RunParts, summary: Any, num_devices: int
) -> list[Any]:
    """One `LoggerHook` per selected logger other than TensorBoard (call on the lead only)."""
    from trainers.config.cli_args import run_overrides
    from trainers.hooks.hparams import hparams
    from trainers.hooks.run_logger import LoggerHook, RunInfo

    loggers = _run_loggers(options)
    if not loggers:
        return []
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    config = {str(k): v for k, v in resolved.items()}
    run = RunInfo(
        name=Path(options.paths.tb_dir).name,
        config=config,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        hparams=dict(hparams(config, run_overrides())[0]),
    )
    return [
        LoggerHook(
            logger,
            run,
            logged_scalars(options, parts, num_devices),
            summary,
            on_error=options.logger.on_error,
        )
        for logger in loggers
    ]


def logger_outputs(options: RunOptions) -> Any:
    """What the selected W&B, MLflow and CSV loggers write (`trainers.rundir.outputs.Outputs`),
    for the start-up check of the run dir (`trainers.rundir.links.check_run_dirs`)."""
    from trainers.rundir.outputs import merged

    return merged(logger.outputs() for logger in _run_loggers(options))


def _run_loggers(options: RunOptions) -> list[Any]:
    """The selected loggers' `RunLogger`s, in the group's order."""
    opts = options.logger
    out: list[Any] = []
    if opts.wandb is not None:
        from trainers.hooks.wandb_logger import WandbRunLogger

        out.append(WandbRunLogger(opts.wandb))
    if opts.mlflow is not None:
        from trainers.hooks.mlflow_logger import MlflowRunLogger

        out.append(MlflowRunLogger(opts.mlflow))
    if opts.csv is not None:
        from trainers.hooks.csv_logger import CsvRunLogger

        out.append(CsvRunLogger(opts.csv.path))
    return out


def tensorboard_hook(
    cfg: DictConfig,
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    summary: RunSummary,
) -> Any:
    """The TensorBoard hook of the lead process, with the run's hparams and resolved config."""
    from trainers.config.cli_args import run_overrides
    from trainers.hooks.hparams import hparams
    from trainers.hooks.perf import step_flops
    from trainers.hooks.tensorboard import TensorBoardHook
    from trainers.tasks.base import tokens_per_example

    opts, logger_opts, trainer = options.trainer, options.logger, parts.trainer
    values, overridden = hparams(started.config, run_overrides())
    return TensorBoardHook(
        where.dirs.tb_dir,
        log_every=opts.log_every,
        global_batch_size=opts.batch_size,
        num_steps=opts.steps,
        hparams=values,
        overridden=overridden,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        flush_secs=logger_opts.flush_secs,
        on_error=logger_opts.on_error,
        noise_ema_steps=logger_opts.noise_ema_steps,
        tokens_per_example=tokens_per_example(parts.task),
        step_flops=lambda: step_flops(trainer.compiled),
        compile_seconds=lambda: trainer.compile_seconds,
        num_devices=where.mesh.size,
        peak_flops_per_device=logger_opts.peak_flops_per_device,
        best_loss=lambda: (summary.best_loss, summary.best_step),
        eval_metrics=started.evaluator.metric_names if started.evaluator else (),
        eval_results=summary.eval_results,
    )
