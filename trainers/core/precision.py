"""Mixed precision in the step: master params in one dtype, the forward and backward in another.

The trainer takes the two dtypes as plain arguments (`Precision`; the app reads them from the
``precision`` node, `trainers.config.precision`):

- the params are stored, updated and checkpointed in ``param_dtype`` (`Precision.master`
  casts a task's floating-point params to it at init, whatever the task made);
- inside the step, the task's loss sees its params cast to ``compute_dtype``
  (`Precision.loss_fn`): every matrix multiplication of a task that computes in the dtype of
  its params (the built-in tasks, Flax modules) runs in it. The cast's own gradient casts the
  gradient back, so it arrives in ``param_dtype``: the cross-shard reduction, the gradient
  statistics, the non-finite guard and the update run on it as in float32 training;
- the loss and its aux metrics are cast to float32 (a task computes its loss in float32 from
  its outputs: the built-in ones do).

Model state (BatchNorm statistics) is the task's own and is not cast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainers.core.model_state import LossFn


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves cast to `dtype` (others as they are)."""
    dtype = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and jnp.result_type(x) != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree)


class Precision(NamedTuple):
    """The dtypes of a run: params (and optimizer state) and computation."""

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32

    @classmethod
    def of(cls, param_dtype: Any = "float32", compute_dtype: Any = "float32") -> Precision:
        """The `Precision` of two dtypes or dtype names (``"bfloat16"``)."""
        return cls(jnp.dtype(param_dtype), jnp.dtype(compute_dtype))

    @property
    def mixed(self) -> bool:
        """Whether the step computes in another dtype than the params are kept in."""
        return jnp.dtype(self.param_dtype) != jnp.dtype(self.compute_dtype)

    def master(self, params: Any) -> Any:
        """The floating-point leaves of `params` in ``param_dtype`` (the master params)."""
        return cast_floating(params, self.param_dtype)

    def loss_fn(self, task_loss: LossFn) -> LossFn:
        """`task_loss` (`trainers.core.model_state.loss_fn`) on params cast to
        ``compute_dtype``, its loss and aux metrics in float32."""
        if not self.mixed:
            return lambda *args: _float32_loss(*task_loss(*args))

        def mixed(params, model_state, batch, rng):
            out = task_loss(cast_floating(params, self.compute_dtype), model_state, batch, rng)
            return _float32_loss(*out)

        return mixed


def _float32_loss(loss: jax.Array, aux: dict, model_state: Any) -> tuple[jax.Array, dict, Any]:
    """The loss and aux metrics in float32 (as they are if they are), the model state as it
    is."""
    return cast_floating(loss, jnp.float32), cast_floating(aux, jnp.float32), model_state
