"""Where a `Trainer`'s arrays live on the mesh: the params (the task's sharding rules, and the
data axes with ``zero_stage=3``), the optimizer state, the batches; and the initial state,
initialised from the seed and placed there: `DevicePlacement`, a part of
`trainers.core.trainer.Trainer` (which replicates the state over a periodic axis,
`trainers.core.periodic.sync.PeriodicPrograms.replicate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.model_state import init_fn
from trainers.core.precision import Precision
from trainers.core.step.optimizer import refuse_nested_cross_shard
from trainers.core.step.types import TrainState, state_shardings
from trainers.core.zero import ZeroLayout
from trainers.tasks.base import Task
from xshard.optim.cross_shard import CrossShardTransformation
from xshard.optim.hyperparams import Hyperparams
from xshard.reduce.per_axis import state_partition_specs

# Folded into the seed for parameter init; steps fold in 0, 1, 2, ... and never reach it.
_INIT_STREAM = 0x7FFFFFFF


class StateShapes(NamedTuple):
    """A `TrainState`'s params and optimizer state as shape structs, with their shardings."""

    params: Any
    param_shardings: Any
    opt_state: Any
    opt_shardings: Any


class DevicePlacement:
    """The shardings of a run's params, optimizer state and batches, and its initial state.

    Args:
      task: the task (`trainers.tasks.base.Task`).
      tx: the optimizer as the step runs it.
      mesh: the device mesh.
      data_axes: the data-parallel mesh axes (a batch is split over them).
      seed: the run's seed (it seeds the params).
      layout: the ZeRO layout (`trainers.core.zero`).
      precision: the dtypes of the params and of the step's computation.
      hyperparams: the float hyperparameters `tx` was built on (`xshard.optim.hyperparams`):
        the program that initialises the optimizer state takes them as inputs too, so runs
        that differ only in them share it; None: constants of `tx`.

    Attributes:
      batch_sharding: a batch's sharding: split over the data axes.
      replicated: the sharding of what every device holds whole (the step counter, the model
        state).
    """

    def __init__(
        self,
        task: Task,
        tx: CrossShardTransformation,
        mesh: Mesh,
        *,
        data_axes: Sequence[str],
        seed: int,
        layout: ZeroLayout,
        precision: Precision,
        hyperparams: Hyperparams | None = None,
    ):
        self.task, self.tx, self.mesh, self.hyperparams = task, tx, mesh, hyperparams
        self.seed, self.layout, self.precision = seed, layout, precision
        self.batch_sharding = NamedSharding(mesh, P(tuple(data_axes)))
        self.replicated = NamedSharding(mesh, P())

    def param_shardings(self, params: Any) -> Any:
        """NamedShardings of `params` at rest: the task's sharding rules, and with
        ``zero_stage=3`` the data axes (`trainers.core.zero`)."""
        return self.layout.params_at_rest(params, self.layout.base_shardings(params))

    def init_variables(self, first_batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
        """The task's params (placed with their shardings, in the precision's param dtype) and
        model state (replicated), initialised from the seed (`trainers.core.model_state`:
        ``{}`` for a plain task)."""
        init, rng, example = self._variables_init(first_batch)
        shapes = jax.eval_shape(init, rng, example)
        shardings = (self.param_shardings(shapes[0]), self.replicated)
        with jax.set_mesh(self.mesh):
            return jax.jit(init, out_shardings=shardings)(rng, example)

    def _variables_init(self, batch: Any) -> tuple[Any, jax.Array, Any]:
        """``(init, rng, example)``: `init_variables`' function of ``(rng, example)``, its key
        and one row of `batch` (arrays, or shape structs with the batch dimension)."""
        example = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
                if isinstance(x, jax.ShapeDtypeStruct)
                else x[:1]
            ),
            batch,
        )
        rng = jax.random.fold_in(jax.random.key(self.seed), _INIT_STREAM)
        task_init, master = init_fn(self.task), self.precision.master

        def init(rng, example):
            params, model_state = task_init(rng, example)
            return master(params), model_state

        return init, rng, example

    def state_shapes(self, batch: Any) -> StateShapes:
        """The params and optimizer state that `init_variables` and `init` would make for
        `batch` (arrays, or shape structs with the batch dimension), as shape structs with
        their shardings: traced with ``jax.eval_shape``, nothing allocated or compiled."""
        init, rng, example = self._variables_init(batch)
        params = jax.eval_shape(init, rng, example)[0]
        with jax.set_mesh(self.mesh):  # the axis rules size their state from the mesh
            opt_state = jax.eval_shape(self.tx.init, params)
            opt_shardings = self.opt_state_shardings(params)
        return StateShapes(params, self.param_shardings(params), opt_state, opt_shardings)

    def init_params(self, first_batch: dict[str, np.ndarray]) -> Any:
        """Initialises the task's params from the seed, placed with their shardings."""
        return self.init_variables(first_batch)[0]

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Returns the initial `TrainState` for `params` and `model_state` (placed on the
        mesh; None: the empty model state of a plain task), of one replica with a periodic
        axis.

        Raises:
          ValueError: for an optimizer holding a `cross_shard` inside another transformation.
        """
        shardings = self.param_shardings(params)
        params = jax.device_put(params, shardings)
        with jax.set_mesh(self.mesh):  # the axis rules size their state from the mesh
            refuse_nested_cross_shard(jax.eval_shape(self.tx.init, params))
            opt_shardings = self.opt_state_shardings(params)
            opt_state = self._init_opt_state(params, opt_shardings)
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        model_state = jax.device_put({} if model_state is None else model_state, self.replicated)
        return TrainState(step, params, opt_state, model_state)

    def _init_opt_state(self, params: Any, shardings: Any) -> Any:
        """The optimizer state of `params`, by a program that takes the hyperparameters as
        inputs when there are any."""
        hyperparams = self.hyperparams
        if hyperparams is None:
            return jax.jit(self.tx.init, out_shardings=shardings)(params)
        init = lambda params, values: hyperparams.build(values).tx.init(params)
        return jax.jit(init, out_shardings=shardings)(params, hyperparams.arrays())

    def opt_state_shardings(self, params: Any) -> Any:
        """Per-parameter optimizer state (adam's mu, nu) is sharded like its parameter's model
        axes, and with ``zero_stage >= 1`` over the data axes too; everything else (counts,
        hyperparameters) is replicated. See `trainers.core.zero.ZeroLayout.opt_state_shardings`.
        The error-feedback residuals of the axis rules (`xshard.reduce.per_axis`) are sharded over
        their axis, a row per replica. Call it with the mesh in context (``jax.set_mesh``)."""
        shardings = self.layout.opt_state_shardings(
            self.tx, params, self.layout.base_shardings(params)
        )
        specs = state_partition_specs(jax.eval_shape(self.tx.init, params))
        return jax.tree.map(
            lambda s, spec: s if spec == P() else NamedSharding(self.mesh, spec), shardings, specs
        )

    def state_shardings(self, state: TrainState) -> Any:
        """The shardings every `TrainState` of this run has (what the step keeps)."""
        return state_shardings(state)

    def global_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local NumPy arrays -> global arrays sharded over the data axes."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            local_batch,
        )

    def as_global(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch` as global arrays: host-local NumPy ones placed (`global_batch`), global ones
        as they are."""
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            return self.global_batch(batch)
        return batch
