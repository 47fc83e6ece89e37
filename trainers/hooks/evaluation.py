"""Evaluation on the task's eval split: a compiled eval step, and the hook that runs it.

A task has an eval split when it has ``eval_batches`` (`trainers.tasks.base.Task`). Every
evaluation reads the same eval batches (at most ``trainer.eval_batches``) of
``trainer.eval_batch_size`` global rows, sharded over the data axes like training batches. A
short batch (the last one of a finite split, or a process's empty share of it) is padded with
zero rows and masked (`trainers.data.padding`); processes whose splits yield fewer batches
than another's (or none) pad the batches they lack (`trainers.hooks.eval_agreement`). So
every example of the split is scored exactly once, on any number of shards and processes:
each metric is the mean over the scored examples (`trainers.hooks.eval_scoring`), of the task's
``eval_metrics(params, batch)`` if it has one (``eval_metrics(params, model_state, batch)``
for a task with model state, `trainers.core.model_state`; with a ``mask`` keyword it gets
the mask), else of its loss with a fixed RNG (``loss`` and the aux metrics; the model state
is read, its update dropped).
Metrics are named ``eval/<name>``; ``eval/loss`` is always among them. The params are cast to
the run's ``precision.compute_dtype`` inside the eval step, as the train step casts them
(`trainers.core.precision`): with ``precision=bf16`` the evaluation's dots run in bfloat16 too,
and its metrics are summed in float32.

The eval step (`trainers.hooks.evaluator.Evaluator`) is its own jitted program over the global
batch, compiled once ahead of time when the run starts (a bad task or eval batch fails before
training, and no evaluation ever recompiles). It only reads the params: training never depends
on it, so a run's trajectory is bitwise the same with evaluation on or off. `EvalHook` evaluates
every ``trainer.eval_every`` steps and at the end of the run (also after a resume that has
nothing left to train, when the data ran out, and when a hook stopped the run early); not when
a stop signal ended it (preemption: the machine is going away) or it failed. Every
evaluation's metrics go to every hook's `Hook.on_eval`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from jax.sharding import Mesh

from trainers.config.run import TRAIN_OBJECTIVE, TrainerOptions
from trainers.core.hook import Hook
from trainers.core.step import TrainState
from trainers.core.stop_vote import StopVote
from trainers.hooks.eval_agreement import AllGather, one_process
from trainers.hooks.evaluator import Evaluator
from trainers.tasks.base import EvalTask, Task
from xshard.errors import ConfigError

logger = logging.getLogger(__name__)

#: Receives each evaluation's metrics: ``(step, {"eval/loss": ..., ...})``.
EvalSink = Callable[[int, dict[str, float]], None]


def has_eval_split(task: Task) -> TypeGuard[EvalTask]:
    """Whether `task` has an eval split: an ``eval_batches`` method, and ``has_eval_split``
    not False."""
    return callable(getattr(task, "eval_batches", None)) and bool(
        getattr(task, "has_eval_split", True)
    )


class EvalHook(Hook):
    """Evaluates every `every` steps and at the end; hands the metrics to `sinks`.

    Args:
      evaluator: a prepared `Evaluator`.
      every: period in steps; 0: only at the end.
      num_steps: the run's ``trainer.steps`` (the last step is always evaluated).
      sinks: called with ``(step, metrics)`` after each evaluation, in order (the other
        hooks' `Hook.on_eval`).
      preempted: whether a stop signal to this process ended the run (then a stopped run is
        not evaluated); one to another process comes as an agreed stop (`on_stop_agreed`).
    """

    def __init__(
        self,
        evaluator: Evaluator,
        *,
        every: int,
        num_steps: int,
        sinks: Sequence[EvalSink],
        preempted: Callable[[], bool] = lambda: False,
    ):
        self.evaluator = evaluator
        self.every = every
        self.num_steps = num_steps
        self.sinks = tuple(sinks)
        self.preempted = preempted
        self.last_step: int | None = None  # the step of the latest evaluation
        self.stopped_by_signal = False  # the agreed stop was a signal, here or elsewhere

    def wants_state(self, step: int) -> bool:
        return step == self.num_steps or (self.every > 0 and step % self.every == 0)

    def on_state(self, step: int, state: TrainState) -> None:
        if self.wants_state(step):  # on_state also comes for other hooks' steps
            self._evaluate(step, state)

    def on_stop_agreed(self, vote: StopVote) -> None:
        self.stopped_by_signal = vote.signal

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        preempted = self.preempted() or self.stopped_by_signal
        if reason != "error" and not preempted:  # a hook's stop evaluates too
            self._evaluate(step, state)

    def _evaluate(self, step: int, state: TrainState) -> None:
        if step == self.last_step:
            return
        start = time.perf_counter()
        metrics = self.evaluator.evaluate(state)
        self.last_step = step
        logger.info(
            "Eval at step %d (%.2f s): %s",
            step,
            time.perf_counter() - start,
            ", ".join(f"{k}={v:.5g}" for k, v in metrics.items()),
        )
        for sink in self.sinks:
            sink(step, metrics)


def build_evaluator(
    task: Task,
    mesh: Mesh,
    state: TrainState,
    *,
    data_axes: Sequence[str],
    opts: TrainerOptions,
    seed: int,
    compute_dtype: Any = None,
    all_gather: AllGather = one_process,
) -> Evaluator | None:
    """The run's prepared `Evaluator`, or None when it does not evaluate; checks
    ``trainer.objective`` against the metrics the evaluation has.

    Args:
      task: the run's task.
      mesh: the device mesh.
      state: the initial state, placed as training keeps it.
      data_axes: the data-parallel mesh axes.
      opts: the run's `xshard.config.TrainerOptions` (``eval_*`` and ``objective``).
      seed: the run's seed.
      compute_dtype: the dtype the eval step computes in (``precision.compute_dtype``,
        `Evaluator`); None: the params' own.
      all_gather: the cluster's exchange of small values
        (`trainers.cluster.multihost.Cluster.all_gather`); the default serves one process.

    Returns:
      None without an eval split or with ``trainer.eval_batches=0``.

    Raises:
      ConfigError: a bad eval batch size, an empty eval split, or an ``eval/`` objective the
        run has no metric for.
    """
    objective = opts.objective
    if not (has_eval_split(task) and opts.eval_batches > 0):
        if objective != TRAIN_OBJECTIVE:
            why = (
                "trainer.eval_batches=0 turns evaluation off"
                if has_eval_split(task)
                else f"task {type(task).__name__} has no eval split"
            )
            raise ConfigError(
                f"trainer.objective={objective!r} needs an evaluation, but {why}; use "
                f"trainer.objective={TRAIN_OBJECTIVE}."
            )
        return None
    explicit = opts.eval_batch_size is not None
    evaluator = Evaluator(
        task,
        mesh,
        data_axes=data_axes,
        global_batch_size=opts.batch_size if opts.eval_batch_size is None else opts.eval_batch_size,
        num_batches=opts.eval_batches,
        seed=seed,
        batch_key="trainer.eval_batch_size" if explicit else "trainer.batch_size",
        compute_dtype=compute_dtype,
        all_gather=all_gather,
    )
    evaluator.prepare(state)
    if objective != TRAIN_OBJECTIVE and objective not in evaluator.metric_names:
        raise ConfigError(
            f"trainer.objective={objective!r}: the evaluation has no such metric; choose one "
            f"of {[TRAIN_OBJECTIVE, *evaluator.metric_names]}."
        )
    return evaluator
