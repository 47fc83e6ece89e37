"""How the `Trainer`'s step is set up: the optimizer as the step runs it (a `cross_shard` over
the axes each replica reduces every step: all data axes but a periodic one; a plain optax
optimizer wrapped once; a nested `cross_shard` refused) and the step's static `StepSpec`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optax
from jax.sharding import Mesh

from trainers.core.periodic import Periodic
from trainers.core.step import StepSpec
from xshard.config.axes import AxisRule, inner_data_axes
from xshard.config.reduction import Reduction
from xshard.errors import ConfigError
from xshard.mesh.build import check_batch_divisible
from xshard.optim.cross_shard import CrossShardTransformation, cross_shard
from xshard.optim.slots import has_cross_shard_state


def periodic_inner_axes(
    data_axes: tuple[str, ...], periodic: tuple[str, AxisRule] | None
) -> tuple[str, ...]:
    """The data axes a step reduces over: all of them, but a periodic one
    (`xshard.config.axes.inner_data_axes`).

    Raises:
      ConfigError: for a periodic axis that is not a data axis, or the only one.
    """
    return inner_data_axes(data_axes, None if periodic is None else periodic[0])


def step_spec(
    mesh: Mesh,
    data_axes: Sequence[str],
    inner_axes: tuple[str, ...],
    periodic: Periodic | None,
    *,
    global_batch_size: int,
    microbatches: int,
    grad_impl: str,
    seed: int,
) -> StepSpec:
    """The `StepSpec` of one replica's step (the whole mesh's without a periodic axis), which
    reduces over `inner_axes` (`periodic_inner_axes`).

    Raises:
      ConfigError: for a batch not divisible over the data shards, or a microbatch count that
        does not divide the per-shard batch.
    """
    per_shard = check_batch_divisible(global_batch_size, mesh, tuple(data_axes))
    n = global_batch_size // per_shard
    if microbatches < 1 or per_shard % microbatches:
        raise ConfigError(
            f"trainer.microbatches={microbatches} must be >= 1 and divide the per-shard "
            f"batch {per_shard} (trainer.batch_size={global_batch_size} over {n} data "
            "shards)."
        )
    replicas = 1 if periodic is None else periodic.replicas
    return StepSpec(
        data_axes=inner_axes,
        num_data_shards=n // replicas,
        global_batch_size=global_batch_size // replicas,
        microbatches=microbatches,
        grad_impl=grad_impl,
        seed=seed,
        replica_axis=None if periodic is None else periodic.axis,
    )


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
