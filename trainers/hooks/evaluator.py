"""The compiled eval step: an `Evaluator` scores params on the task's eval split.

One jitted program over the global eval batch, lowered and compiled once ahead of time
(`Evaluator.prepare`) for the params and model state as training places them; each evaluation
runs it on every eval batch, this process's rows padded and masked (`trainers.data.padding`,
the batch count agreed between processes by `trainers.hooks.eval_agreement`), and adds up the
masked sums of `trainers.hooks.eval_scoring` into the mean of each metric over the examples.
The hook that decides when to evaluate is `trainers.hooks.evaluation`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.config.run import EVAL_PREFIX
from trainers.core.periodic import outer_params
from trainers.core.precision import cast_floating
from trainers.core.step import TrainState
from trainers.data.batch import Batch
from trainers.data.padding import pad_rows, padding_like
from trainers.hooks.eval_agreement import AllGather, agreed_batches, one_process
from trainers.hooks.eval_scoring import masked_sums, metrics_fn
from trainers.tasks.base import EvalTask
from xshard.errors import ConfigError
from xshard.mesh.build import check_batch_divisible

logger = logging.getLogger(__name__)

#: Folded into the seed for the RNG `loss` gets during evaluation (steps never reach it).
_EVAL_STREAM = 0x7FFFFFFE


class Evaluator:
    """Evaluates params on the task's eval split with one compiled program.

    Args:
      task: a task with an eval split (`trainers.hooks.evaluation.has_eval_split`).
      mesh: the device mesh.
      data_axes: the data-parallel mesh axes the eval batch is split over.
      global_batch_size: rows of a global eval batch.
      num_batches: eval batches per evaluation (>= 1).
      seed: the run's seed (the eval split's and the RNG's).
      batch_key: the config key of `global_batch_size`, for error messages.
      compute_dtype: the dtype the floating-point params are cast to in the eval step
        (``precision.compute_dtype``); None: as they are stored.
      all_gather: how the processes exchange their batch counts
        (`trainers.cluster.multihost.Cluster.all_gather`); the default serves one process.

    Raises:
      ConfigError: the batch does not split over the data shards or the processes.
      ValueError: several processes and no `all_gather`.
    """

    def __init__(
        self,
        task: EvalTask,
        mesh: Mesh,
        *,
        data_axes: Sequence[str],
        global_batch_size: int,
        num_batches: int,
        seed: int,
        batch_key: str = "trainer.eval_batch_size",
        compute_dtype: Any = None,
        all_gather: AllGather = one_process,
    ):
        if all_gather is one_process and jax.process_count() > 1:
            raise ValueError("Evaluator: several processes need the cluster's all_gather.")
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
        self.all_gather = all_gather
        self._agreements = 0  # names each exchange of `agreed_batches` uniquely
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
        self._agreements += 1
        name = f"eval/batches/{self._agreements}"
        self.count, template = agreed_batches(count, first, all_gather=self.all_gather, name=name)
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
