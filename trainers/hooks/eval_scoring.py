"""Scoring an eval batch with a mask: every real row counts once, padding never.

The evaluation pads the last, short batch of a finite split (`trainers.data.padding`) and
hands each batch's mask here. The result of a batch is, per metric, the sum over its real
rows of the metric's value and the number of real rows; the evaluation divides the totals,
so each metric is the mean over the examples of the split, whatever the batch size, the
number of shards or processes.

How a row's value is found, for the task's metric function ``eval_metrics`` (or, without
one, ``loss`` with a fixed RNG and its aux metrics):

- a function with a ``mask`` keyword (``eval_metrics(params, batch, *, mask)``, or
  ``(params, model_state, batch, *, mask)`` with model state) returns the means over the
  rows whose mask is 1.0; a batch counts with the weight ``sum(mask)``;
- any other function returns the means over the batch it is given (the contract before
  masks): it is called on each row alone (``jax.vmap`` over single-row batches), which
  gives per-example values for metrics that are means over examples, and the padding rows'
  values are dropped (``jnp.where``, so a NaN from a zero row never reaches the sum).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trainers.core.model_state import is_stateful, loss_fn
from trainers.tasks.base import Task

#: A batch's metrics: ``(params, model_state, batch[, mask=]) -> {name: scalar}``.
MetricsFn = Callable[..., dict[str, jax.Array]]


def accepts_mask(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes a ``mask`` argument by keyword."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no mask
        return False
    mask = parameters.get("mask")
    return mask is not None and mask.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def metrics_fn(task: Task, rng: jax.Array) -> tuple[MetricsFn, bool]:
    """The task's batch metrics as ``(params, model_state, batch[, mask=]) -> dict``, and
    whether it takes the mask.

    Args:
      task: the task: its ``eval_metrics`` if it has one, else ``loss`` (and its aux metrics).
      rng: the RNG ``loss`` gets.
    """
    eval_metrics = getattr(task, "eval_metrics", None)
    if not callable(eval_metrics):
        run_loss = loss_fn(task)

        def from_loss(params: Any, model_state: Any, batch: Any) -> dict[str, jax.Array]:
            loss, aux, _ = run_loss(params, model_state, batch, rng)
            return {**aux, "loss": loss}

        return from_loss, False
    stateful = is_stateful(task)

    def call(params: Any, model_state: Any, batch: Any, **mask: Any) -> dict[str, jax.Array]:
        args = (params, model_state, batch) if stateful else (params, batch)
        metrics = dict(eval_metrics(*args, **mask))
        if "loss" not in metrics:
            raise ValueError(
                f"{type(task).__name__}.eval_metrics returned {sorted(metrics)}: it must "
                "return 'loss' too."
            )
        return metrics

    return call, accepts_mask(eval_metrics)


def _scalars(metrics: dict[str, Any], task: Task) -> dict[str, jax.Array]:
    out = {}
    for name, value in metrics.items():
        value = jnp.asarray(value, jnp.float32)
        if value.shape != ():
            raise ValueError(
                f"eval metric {name!r} of {type(task).__name__} has shape {value.shape}; "
                "metrics must be scalars (means over the batch)."
            )
        out[name] = value
    return out


def masked_sums(
    task: Task,
    fn: MetricsFn,
    takes_mask: bool,
    variables: tuple[Any, Any],
    batch: Any,
    mask: jax.Array,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Per metric, the sum of its values over the real rows of `batch`; and their number.

    Args:
      task: the task (for messages).
      fn: its batch metrics (`metrics_fn`).
      takes_mask: whether `fn` takes ``mask=`` (module docstring).
      variables: ``(params, model_state)``.
      batch: the padded batch (traced).
      mask: 1.0 per real row, 0.0 per padding row.

    Returns:
      ``({name: sum over real rows}, number of real rows)``, float32 scalars.
    """
    count = jnp.sum(mask, dtype=jnp.float32)
    if takes_mask:
        means = _scalars(fn(*variables, batch, mask=mask), task)
        return {k: jnp.where(count > 0, v * count, 0.0) for k, v in means.items()}, count

    def one_row(row: Any) -> dict[str, jax.Array]:
        single = jax.tree.map(lambda x: x[None], row)
        return _scalars(fn(*variables, single), task)

    per_row = jax.vmap(one_row)(batch)
    real = mask > 0
    sums = {k: jnp.sum(jnp.where(real, v, 0.0), dtype=jnp.float32) for k, v in per_row.items()}
    return sums, count
