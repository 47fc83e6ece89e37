"""Evaluation on the task's eval split: a compiled eval step, and the hook that runs it.

A task has an eval split when it has ``eval_batches`` (`trainers.tasks.base.Task`). Every
evaluation reads the same eval batches (at most ``trainer.eval_batches``) of
``trainer.eval_batch_size`` global rows, sharded over the data axes like training batches. A
short batch (the last one of a finite split, or a process's empty share of it) is padded with
zero rows and masked (`trainers.data.padding`); processes whose splits yield fewer batches
than another's (or none) pad the batches they lack (`agreed_batches`). So every example of
the split is scored exactly once, on any number of shards and processes: each metric is the
mean over the scored examples (`trainers.hooks.eval_scoring`), of the task's
``eval_metrics(params, batch)`` if it has one (``eval_metrics(params, model_state, batch)``
for a task with model state, `trainers.core.model_state`; with a ``mask`` keyword it gets
the mask), else of its loss with a fixed RNG (``loss`` and the aux metrics; the model state
is read, its update dropped).
Metrics are named ``eval/<name>``; ``eval/loss`` is always among them. The params are cast to
the run's ``precision.compute_dtype`` inside the eval step, as the train step casts them
(`trainers.core.precision`): with ``precision=bf16`` the evaluation's dots run in bfloat16 too,
and its metrics are summed in float32.

The eval step is its own jitted program over the global batch, compiled once ahead of time
when the run starts (a bad task or eval batch fails before training, and no evaluation ever
recompiles). It only reads the params: training never depends on it, so a run's trajectory is
bitwise the same with evaluation on or off. `EvalHook` evaluates every ``trainer.eval_every``
steps and at the end of the run (also after a resume that has nothing left to train, when the
data ran out, and when a hook stopped the run early); not when a stop signal ended it
(preemption: the machine is going away) or it failed. Every evaluation's metrics go to every
hook's `Hook.on_eval`.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.config.run import EVAL_PREFIX, TRAIN_OBJECTIVE, TrainerOptions
from trainers.core.hook import Hook
from trainers.core.periodic import outer_params
from trainers.core.precision import cast_floating
from trainers.core.step import TrainState
from trainers.data.batch import Batch
from trainers.data.padding import empty_batch, pad_rows, padding_like, row_layout
from trainers.hooks.eval_scoring import masked_sums, metrics_fn
from xshard.errors import ConfigError
from xshard.mesh import check_batch_divisible

logger = logging.getLogger(__name__)

#: Folded into the seed for the RNG `loss` gets during evaluation (steps never reach it).
_EVAL_STREAM = 0x7FFFFFFE

#: Receives each evaluation's metrics: ``(step, {"eval/loss": ..., ...})``.
EvalSink = Callable[[int, dict[str, float]], None]


def has_eval_split(task: Any) -> bool:
    """Whether `task` has an eval split: an ``eval_batches`` method, and ``has_eval_split``
    not False."""
    return callable(getattr(task, "eval_batches", None)) and bool(
        getattr(task, "has_eval_split", True)
    )


class Evaluator:
    """Evaluates params on the task's eval split with one compiled program.

    Args:
      task: a task with an eval split (`has_eval_split`).
      mesh: the device mesh.
      data_axes: the data-parallel mesh axes the eval batch is split over.
      global_batch_size: rows of a global eval batch.
      num_batches: eval batches per evaluation (>= 1).
      seed: the run's seed (the eval split's and the RNG's).
      batch_key: the config key of `global_batch_size`, for error messages.
      compute_dtype: the dtype the floating-point params are cast to in the eval step
        (``precision.compute_dtype``); None: as they are stored.

    Raises:
      ConfigError: the batch does not split over the data shards or the processes.
    """

    def __init__(
        self,
        task: Any,
        mesh: Mesh,
        *,
        data_axes: Sequence[str],
        global_batch_size: int,
        num_batches: int,
        seed: int,
        batch_key: str = "trainer.eval_batch_size",
        compute_dtype: Any = None,
    ):
        check_batch_divisible(global_batch_size, mesh, tuple(data_axes), key=batch_key)
        if global_batch_size % jax.process_count():
            raise ConfigError(
                f"{batch_key}={global_batch_size} is not divisible by the number of processes "
                f"{jax.process_count()}."
            )
        self.task, self.mesh = task, mesh
        self.global_batch_size = global_batch_size
        self.local_rows = global_batch_size // jax.process_count()
        self.num_batches = num_batches
        self.seed = seed
        self.batch_key = batch_key
        self.compute_dtype = compute_dtype
        self.batch_sharding = NamedSharding(mesh, P(tuple(data_axes)))
        self._replicated = NamedSharding(mesh, P())
        self._rng = jax.random.fold_in(jax.random.key(seed), _EVAL_STREAM)
        self._compiled: jax.stages.Compiled | None = None
        #: Names of the metrics (``eval/<name>``), in the order the program returns them.
        self.metric_names: tuple[str, ...] = ()
        #: How many times the eval step was compiled (once per run).
        self.compiles = 0
        #: Eval batches per evaluation, set by `prepare`: the most any process has.
        self.count = 0
        #: Examples (real rows) the latest evaluation scored.
        self.examples = 0
        self._template: Batch = {}
        self._warned_short = False

    def _batches(self) -> Iterator[tuple[Batch, np.ndarray]]:
        """This process's rows of the eval batches (at most `num_batches`), each padded to
        its share of the global batch, with its mask (`trainers.data.padding`)."""
        batches = self.task.eval_batches(
            self.global_batch_size,
            seed=self.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        for local in itertools.islice(batches, self.num_batches):
            try:
                yield pad_rows(local, self.local_rows)
            except ValueError as e:
                raise ValueError(
                    f"{type(self.task).__name__}.eval_batches: {e} (this process's share of "
                    f"{self.batch_key}={self.global_batch_size})."
                ) from None

    def prepare(self, state: TrainState) -> None:
        """Compiles the eval step for `state`'s params and model state (placed as training
        keeps them) and the eval batches, once; sets `metric_names` and counts the batches
        (the most any process has: the others pad).

        Raises:
          ConfigError: the eval split yields no batch.
        """
        start = time.perf_counter()
        lowered = self.lower(state)
        self._compiled = lowered.compile()
        self.compiles += 1
        logger.info(
            "Compiled the eval step (%d batches of %d) in %.2f s.",
            self.count,
            self.global_batch_size,
            time.perf_counter() - start,
        )

    def lower(self, state: TrainState) -> jax.stages.Lowered:
        """The eval step's program for `state` and the eval batches, traced and lowered, not
        compiled (its StableHLO says which dtypes it computes in); sets `metric_names` and
        `count` (`prepare` compiles it).

        Raises:
          ConfigError: the eval split yields no batch.
        """
        count, first = 0, None
        for local, _ in self._batches():
            count, first = count + 1, local if first is None else first
        self.count, template = agreed_batches(count, first)
        if template is None:
            raise ConfigError(
                f"{self.batch_key}={self.global_batch_size}: the task's eval split yields no "
                "batch; give it examples, or trainer.eval_batches=0 to turn evaluation off."
            )
        self._template = template
        global_batch, mask = self._global(*padding_like(template, self.local_rows))
        variables = (outer_params(state), state.model_state)
        fn, takes_mask = metrics_fn(self.task, self._rng)

        def sums_of(params, model_state, batch, mask):
            if self.compute_dtype is not None:
                params = cast_floating(params, self.compute_dtype)
            return masked_sums(self.task, fn, takes_mask, (params, model_state), batch, mask)

        shapes = jax.eval_shape(sums_of, *variables, global_batch, mask)[0]
        names = tuple(sorted(shapes))

        def eval_step(params, model_state, batch, mask, sums):
            metrics, rows = sums_of(params, model_state, batch, mask)
            return sums + jnp.stack([*(metrics[n] for n in names), rows])

        shardings = jax.tree.map(lambda x: x.sharding, variables)
        jitted = jax.jit(
            eval_step,
            in_shardings=(*shardings, self.batch_sharding, self.batch_sharding, self._replicated),
            out_shardings=self._replicated,
        )
        self.metric_names = tuple(EVAL_PREFIX + n for n in names)
        with jax.set_mesh(self.mesh):
            return jitted.lower(*variables, global_batch, mask, self._zeros(len(names) + 1))

    def _zeros(self, n: int) -> jax.Array:
        return jax.device_put(np.zeros((n,), np.float32), self._replicated)

    def _global(self, local: Batch, mask: np.ndarray) -> tuple[dict[str, jax.Array], jax.Array]:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            (local, mask),
        )

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """The mean metrics of `state` over the eval examples, ``{"eval/loss": ..., ...}``:
        every real row of the eval batches scored once (`trainers.hooks.eval_scoring`).

        Runs the compiled step on each batch, at most two in flight, and waits for the
        result: `state` may be donated to the next train step right after. A process with
        fewer batches than another scores batches of padding, so all run `count` steps.

        Raises:
          RuntimeError: if `prepare` was not called.
        """
        if self._compiled is None:
            raise RuntimeError("Evaluator.prepare(state) must run before evaluate.")
        sums = self._zeros(len(self.metric_names) + 1)
        batches = self._batches()
        for _ in range(self.count):
            local = next(batches, None) or padding_like(self._template, self.local_rows)
            previous = sums
            sums = self._compiled(
                outer_params(state), state.model_state, *self._global(*local), previous
            )
            previous.block_until_ready()  # bounds the steps in flight (XLA:CPU collectives)
        totals = np.asarray(jax.device_get(sums), np.float64)
        self.examples = int(totals[-1])
        if self.count < self.num_batches and not self._warned_short:
            self._warned_short = True
            logger.info(
                "The eval split has %d batches of %d (%d examples), fewer than "
                "trainer.eval_batches=%d: each evaluation scores those.",
                self.count,
                self.global_batch_size,
                self.examples,
                self.num_batches,
            )
        values = totals[:-1] / max(totals[-1], 1.0)
        return {name: float(v) for name, v in zip(self.metric_names, values)}


def agreed_batches(count: int, first: Batch | None) -> tuple[int, Batch | None]:
    """The most eval batches any process has, and a batch to lay padding out like.

    Every process calls it (collectives). A process whose split yields no batch while
    another's does gets an empty batch laid out like the first such process's (the layout
    is broadcast as JSON), so it pads as many batches as the others score.

    Args:
      count: this process's eval batches.
      first: its first one (None: it has none).

    Returns:
      ``(most batches of any process, first or an empty batch like another's)``; the batch
      is None only when no process has any.
    """
    if jax.process_count() == 1:
        return count, first
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int32(count))).reshape(-1)
    most = int(counts.max())
    if most == 0 or counts.min() > 0:
        return most, first
    source = int(np.argmax(counts > 0))  # every process agrees: the first with a batch
    is_source = jax.process_index() == source
    text = json.dumps(row_layout(first) if is_source and first is not None else {})
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text)), is_source=is_source))
    data = np.frombuffer(text.encode().ljust(size, b" ")[:size], np.uint8)
    data = multihost_utils.broadcast_one_to_all(data, is_source=is_source)
    layout = json.loads(np.asarray(data, np.uint8).tobytes().decode())
    return most, first if first is not None else empty_batch(layout)


class EvalHook(Hook):
    """Evaluates every `every` steps and at the end; hands the metrics to `sinks`.

    Args:
      evaluator: a prepared `Evaluator`.
      every: period in steps; 0: only at the end.
      num_steps: the run's ``trainer.steps`` (the last step is always evaluated).
      sinks: called with ``(step, metrics)`` after each evaluation, in order (the other
        hooks' `Hook.on_eval`).
      preempted: whether a stop signal ended the run (then a stopped run is not evaluated).
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
        self.sinks = list(sinks)
        self.preempted = preempted
        self.last_step: int | None = None  # the step of the latest evaluation

    def wants_state(self, step: int) -> bool:
        return step == self.num_steps or (self.every > 0 and step % self.every == 0)

    def on_state(self, step: int, state: TrainState) -> None:
        if self.wants_state(step):  # on_state also comes for other hooks' steps
            self._evaluate(step, state)

    def on_end(self, step: int, state: TrainState, reason: str) -> None:
        if reason != "error" and not self.preempted():  # a hook's stop evaluates too
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
    task: Any,
    mesh: Mesh,
    state: TrainState,
    *,
    data_axes: Sequence[str],
    opts: TrainerOptions,
    seed: int,
    compute_dtype: Any = None,
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

    Returns:
      None without an eval split or with ``trainer.eval_batches=0``.

    Raises:
      ConfigError: a bad eval batch size, an empty eval split, or an ``eval/`` objective the
        run has no metric for.
    """
    enabled = has_eval_split(task) and opts.eval_batches > 0
    objective = opts.objective
    if not enabled:
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
    )
    evaluator.prepare(state)
    if objective != TRAIN_OBJECTIVE and objective not in evaluator.metric_names:
        raise ConfigError(
            f"trainer.objective={objective!r}: the evaluation has no such metric; choose one "
            f"of {[TRAIN_OBJECTIVE, *evaluator.metric_names]}."
        )
    return evaluator
