"""The step's static `StepSpec` of a run: the data axes each replica reduces over every step
(all but a periodic one), its shards, batch and microbatches, checked against the mesh."""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh

from trainers.core.periodic.axis import Periodic
from trainers.core.step.types import StepSpec
from xshard.config.axes import AxisRule, inner_data_axes
from xshard.errors import ConfigError
from xshard.mesh.build import check_batch_divisible


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
