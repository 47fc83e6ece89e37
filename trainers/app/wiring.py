"""The run's hooks, in the order they see each step (`run_hooks`): the one place every
built-in hook is attached."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from trainers.app.builders import RunOptions, RunParts
from trainers.app.loggers import logger_hook
from trainers.app.memory_preflight import StepMemoryCheck
from trainers.app.stages import Placement, Started
from trainers.cluster.preemption import StopOnSignal
from trainers.hooks.summary import RunSummary


def run_hooks(
    cfg: DictConfig,
    options: RunOptions,
    where: Placement,
    parts: RunParts,
    started: Started,
    summary: RunSummary,
    monitor: Any,
    stop: StopOnSignal,
) -> list[Any]:
    """The run's hooks in the order they see each step, the user's own last.

    The monitor comes before the hooks that act on a step: a bad step raises before they see
    it. The summary only records, so it sees the step that diverged too. Logs and the progress
    bar come from one process. Every evaluation goes to every other hook's ``on_eval``, the
    evaluation comes before the loggers (their ``on_end`` writes the final one) and runs once
    more when a hook stops the run early, not when a stop signal does.
    """
    from trainers.hooks.early_stopping import early_stopping_hook
    from trainers.hooks.monitor import ProgressHook
    from trainers.hooks.perf import ProfileHook

    opts, ckpt, dirs = options.trainer, options.checkpoint, where.dirs
    lead, start_step = where.cluster.lead, started.start_step
    summary.begin(
        num_steps=opts.steps,
        start_step=start_step,
        checkpoint_dir=dirs.checkpoint_dir if ckpt.enabled else None,
        objective=opts.objective,
    )
    memory = StepMemoryCheck(where.mesh.local_devices, opts.batch_size, where.cluster.agreed)
    before: list[Any] = [memory, summary, monitor]  # the hooks before the evaluation
    after: list[Any] = []
    names = started.evaluator.metric_names if started.evaluator is not None else ()
    early = early_stopping_hook(opts.early_stopping, names)
    if early is not None:
        after.append(early)
    log_hook = logger_hook(cfg, options, where, parts, started, summary) if lead else None
    if log_hook is not None:  # TensorBoard, W&B, MLflow, CSV: one hook, the same scalars
        after.append(log_hook)
    if lead and opts.profile_steps is not None:
        after.append(ProfileHook(dirs.tb_dir, *opts.profile_steps, start_step=start_step))
    after.append(
        ProgressHook(start_step=start_step, num_steps=opts.steps, enabled=opts.progress and lead)
    )
    if ckpt.enabled:
        after.append(checkpoint_hook(options, where, started, parts.trainer.row_order))
    after += list(parts.hooks)  # the user's after the built-in ones
    sinks = [h.on_eval for h in before + after if _has_on_eval(h)]
    evaluation = evaluation_hook(options, parts, started, stop, sinks)
    return before + ([evaluation] if evaluation is not None else []) + after


def _has_on_eval(hook: Any) -> bool:
    """Whether `hook` takes evaluations (a user's hook need not subclass `trainers.Hook`)."""
    return callable(getattr(hook, "on_eval", None))


def evaluation_hook(
    options: RunOptions,
    parts: RunParts,
    started: Started,
    stop: StopOnSignal,
    sinks: list[Any],
) -> Any:
    """The evaluation hook (None without an evaluator), handing each evaluation to `sinks` (the
    other hooks' ``on_eval``): it skips the final evaluation when a stop signal, here or to
    another process, ended the run."""
    from trainers.hooks.evaluation import EvalHook

    if started.evaluator is None:
        return None
    opts = options.trainer  # a signal to another process: `EvalHook.on_stop_agreed`
    return EvalHook(
        started.evaluator,
        every=opts.eval_every or 0,  # null was read as 0 (`TrainerOptions`)
        num_steps=opts.steps,
        sinks=sinks,
        preempted=stop,
    )


def checkpoint_hook(
    options: RunOptions, where: Placement, started: Started, saved_order: Any = None
) -> Any:
    """The checkpoint hook, created after the restore (its manager prunes old steps when
    saving), with the data iterator's state when it has one; `saved_order`: the state as
    checkpoints hold it (`trainers.core.trainer.Trainer.row_order`)."""
    from trainers.app.population_run import trial_seat
    from trainers.checkpoint.data_state import is_checkpointable
    from trainers.checkpoint.save import CheckpointHook

    data = started.data if is_checkpointable(started.data) else None
    seat = trial_seat()  # a population's trials save in turns (`CheckpointHook`'s `serial`)
    serial = None if seat is None else seat.population.saving
    hook = CheckpointHook(
        where.dirs.checkpoint_dir, options.checkpoint, started.config, data, serial, saved_order
    )
    hook.prepare(started.state)  # compiles its check now, not during the first save
    return hook
