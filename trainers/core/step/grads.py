"""The loss and gradient of one shard's batch: means over its microbatches (`loss_and_grads`),
accumulated in float32 and nothing reduced across shards; the step
(`trainers.core.step.train_step`) reduces them."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainers.core.model_state import LossFn


class LossAndGrads(NamedTuple):
    """`loss_and_grads`' result: means over the microbatches, and the new model state."""

    loss: jax.Array
    aux: dict[str, jax.Array]
    grads: Any
    model_state: Any


def _split_microbatches(batch: Any, k: int) -> Any:
    """(b, ...) -> (k, b // k, ...): microbatch j holds rows j, j + k, j + 2k, ..."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def loss_and_grads(
    loss_fn: LossFn,
    params: Any,
    model_state: Any,
    batch: Any,
    rng: jax.Array,
    k: int,
) -> LossAndGrads:
    """Mean loss, mean aux, mean gradient and the new model state over `k` microbatches.

    `loss_fn` is `trainers.core.model_state.loss_fn` of the task. Gradients accumulate in float32
    across a `lax.scan` and are cast back to the params' dtypes once at the end; the model
    state passes through the microbatches in order. Nothing is reduced across shards here.
    """

    def with_state(p, state, b, r):
        loss, aux, state = loss_fn(p, state, b, r)
        return loss, (aux, state)

    grad_fn = jax.value_and_grad(with_state, has_aux=True)
    if k == 1:
        (loss, (aux, model_state)), grads = grad_fn(params, model_state, batch, rng)
        return LossAndGrads(loss, aux, grads, model_state)

    def body(carry, xs):
        acc, state = carry
        mb, i = xs
        (loss, (aux, state)), grads = grad_fn(params, state, mb, jax.random.fold_in(rng, i))
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return (acc, state), (loss, aux)

    acc0 = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    (acc, model_state), (losses, auxes) = jax.lax.scan(
        body, (acc0, model_state), (_split_microbatches(batch, k), jnp.arange(k))
    )
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
    return LossAndGrads(jnp.mean(losses), aux, grads, model_state)
