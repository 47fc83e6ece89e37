"""The steps xshard is compared with, written the way a good JAX engineer writes them by hand.

* `jit_step` — MaxText style: the loss's gradient under plain ``jax.jit`` with explicit in/out
  shardings (params replicated, batch split over ``data``), so GSPMD inserts the gradient
  all-reduce; params and optimizer state donated; only the loss comes back.
* `pmap_step` — flax-examples style: ``jax.pmap`` over the devices, ``lax.pmean`` of the
  gradients and the loss, params and optimizer state donated.
* `shard_map_step` — xshard without the trainer: per-shard gradients in ``jax.shard_map``
  reduced by `xshard.cross_shard` (with its statistics off), and nothing else. It separates
  what the library's reduction costs from what the trainer's statistics cost.

All take a task's ``loss(params, batch, rng)``; the built-in tasks are deterministic, so the
RNG is None here (the trainer derives one per step, a negligible fold-in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Step = Callable[..., Any]


def _loss_and_grad(task: Any, params: Any, batch: Any) -> tuple[jax.Array, Any]:
    (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch, None)
    return loss, grads


def jit_step(
    task: Any,
    opt: optax.GradientTransformation,
    state_shardings: tuple[Any, Any],
    batch_sharding: NamedSharding,
) -> Step:
    """``jit(step)(params, opt_state, batch) -> (params, opt_state, loss)`` with GSPMD.

    Args:
      task: the task (its ``loss``).
      opt: a plain optax optimizer.
      state_shardings: (params shardings, optimizer-state shardings).
      batch_sharding: the batch's sharding (split over the data axis).

    Returns:
      The jitted step; its first two arguments are donated.
    """

    def step(params, opt_state, batch):
        loss, grads = _loss_and_grad(task, params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params_sh, opt_sh = state_shardings
    scalar = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(
        step,
        in_shardings=(params_sh, opt_sh, batch_sharding),
        out_shardings=(params_sh, opt_sh, scalar),
        donate_argnums=(0, 1),
    )


def pmap_step(
    task: Any, opt: optax.GradientTransformation, devices: Sequence[Any], axis_name: str = "data"
) -> Step:
    """``pmap(step)(params, opt_state, batch) -> (params, opt_state, loss)`` with ``pmean``.

    Args:
      task: the task (its ``loss``).
      opt: a plain optax optimizer.
      devices: the devices to map over (leading axis of every argument).
      axis_name: the pmap axis name.

    Returns:
      The pmapped step; its first two arguments are donated.
    """

    def step(params, opt_state, batch):
        loss, grads = _loss_and_grad(task, params, batch)
        grads = jax.lax.pmean(grads, axis_name)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis_name)

    return jax.pmap(step, axis_name=axis_name, devices=list(devices), donate_argnums=(0, 1))


def _to_devices(tree: Any, devices: Sequence[Any], axis_name: str) -> Any:
    """Places (n, ...) host arrays one slice per device, with the sharding a pmap of
    `axis_name` over `devices` returns (other placements would make the step's second call,
    fed its own outputs, compile again)."""
    return jax.pmap(lambda x: x, axis_name=axis_name, devices=list(devices))(tree)


def replicate(tree: Any, devices: Sequence[Any], axis_name: str = "data") -> Any:
    """Copies every leaf of `tree` to each of `devices`, stacked on a new leading axis (pmap)."""
    n = len(devices)
    stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), tree)
    return _to_devices(stacked, devices, axis_name)


def split_for_pmap(
    batch: dict[str, np.ndarray], devices: Sequence[Any], axis_name: str = "data"
) -> Any:
    """(B, ...) host arrays -> (n, B / n, ...) arrays with one slice on each of `devices`."""
    n = len(devices)
    shaped = {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in batch.items()}
    return _to_devices(shaped, devices, axis_name)


def shard_map_step(
    task: Any,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    state_shardings: Any,
    batch_sharding: NamedSharding,
    data_axes: tuple[str, ...] = ("data",),
) -> Step:
    """``jit(step)((params, opt_state), batch) -> ((params, opt_state), loss)`` in shard_map.

    The step of the xshard contract without the trainer: params cast to varying, per-shard
    gradients, `tx` (a `cross_shard` optimizer) reduces them, the loss is averaged.

    Args:
      task: the task (its ``loss``).
      tx: a `xshard.cross_shard` optimizer (e.g. with ``track_stats=False``).
      mesh: the mesh; `data_axes` are manual inside the step.
      state_shardings: shardings of ``(params, opt_state)``.
      batch_sharding: the batch's sharding.
      data_axes: the data-parallel axes.

    Returns:
      The jitted step; its state argument is donated.
    """

    def per_shard(params, opt_state, batch):
        local = jax.lax.pcast(params, data_axes, to="varying")
        loss, grads = _loss_and_grad(task, local, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.lax.pmean(loss, data_axes)

    def step(state, batch):
        params, opt_state, loss = jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(P(), P(), P(data_axes)),
            out_specs=(P(), P(), P()),
            axis_names=set(data_axes),
        )(*state, batch)
        return (params, opt_state), loss

    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,),
    )
