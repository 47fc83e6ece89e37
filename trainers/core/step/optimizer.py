"""The optimizer as the step runs it: a `cross_shard` over the axes each replica reduces every
step, a plain optax optimizer wrapped once, a nested `cross_shard` refused."""

from __future__ import annotations

from typing import Any

import optax

from xshard.config.reduction import Reduction
from xshard.optim.cross_shard import CrossShardTransformation, cross_shard
from xshard.optim.slots import has_cross_shard_state


def as_cross_shard(
    tx: optax.GradientTransformation,
    reduction: Reduction | str | None,
    data_axes: tuple[str, ...],
) -> CrossShardTransformation:
    """`tx` as the step runs it: a `cross_shard` optimizer as it is, a plain optax one wrapped
    once in ``cross_shard(tx, reduction, axis_name=data_axes)``.

    Args:
      tx: the `Trainer`'s optimizer.
      reduction: the reduction of a plain `tx` (None: MEAN); with a `cross_shard` `tx`,
        None or its own.
      data_axes: the data-parallel mesh axes (the gradients are reduced over them).

    Returns:
      The `CrossShardTransformation`.

    Raises:
      ValueError: for an unknown `reduction`, or one that disagrees with `tx`'s.
    """
    if not isinstance(tx, CrossShardTransformation):
        return cross_shard(
            tx, Reduction.MEAN if reduction is None else reduction, axis_name=data_axes
        )
    if reduction is not None and Reduction.parse(reduction) is not tx.spec.reduction:
        raise ValueError(
            f"reduction={reduction!r} disagrees with the optimizer's "
            f"{tx.spec.reduction.value!r}: a cross_shard optimizer reduces as it was built. "
            "Leave reduction= out, or pass the inner optax optimizer."
        )
    return tx


def refuse_nested_cross_shard(opt_state: Any) -> None:
    """Refuses an optimizer state with a `cross_shard` state inside the outer one's inner
    state: `tx` held a `cross_shard` inside another transformation (an ``optax.chain``), so
    the trainer wrapped it, and every gradient would be reduced twice.

    Args:
      opt_state: the state (or its shapes) of `Trainer.tx`.

    Raises:
      ValueError: naming what to pass instead.
    """
    if has_cross_shard_state(opt_state.inner_state):
        raise ValueError(
            "The optimizer holds an xshard.cross_shard inside another transformation (e.g. "
            "optax.chain(cross_shard(...), ...)), so the Trainer wrapped it in a cross_shard "
            "of its own and would reduce every gradient twice. Put the other transformations "
            "inside the cross_shard, as xshard.build_optimizer does: "
            "cross_shard(optax.chain(inner, ...), ...); or pass the plain optax optimizer, "
            "which the Trainer wraps once (reduction=...)."
        )
