"""The train step's ZeRO parts (`trainers.core.zero`): where the gradient is reduced, and the
sharding constraints that make GSPMD run the optimizer on each device's slice.

* ``grad_impl=manual``: the shard_map computes each shard's gradient and runs the first phase
  of the cross-shard optimizer there (per-shard clip, local statistics, the reduction: an
  all-reduce at stage 1, at stages 2 and 3 one reduce-scatter per dtype,
  `xshard.CrossShardPhases`, `xshard.buckets`); the second phase (summary, non-finite guard,
  inner optimizer) runs outside it, under GSPMD, on the slices. Microbatches accumulate
  locally and are reduced once.
* ``grad_impl=gspmd``: the compiler reduces the gradient; constraining it to the sharded layout
  asks for a reduce-scatter (stages 2 and 3), or an all-reduce then a slice (stage 1).

In both, the params are constrained to the sharded layout for the update (a local slice at
stages 1 and 2, already so at stage 3), so the update is computed on 1/N of every array; the
new params are then all-gathered (stages 1 and 2), or kept sliced and gathered for the next
forward pass (stage 3), one all-gather per dtype (`gather`). A norm over a sharded array is a
global norm under GSPMD, which keeps lamb, lars, adafactor and global-norm clipping exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec as P

from trainers.core.zero import ZeroLayout
from xshard.buckets import all_gather_tree
from xshard.errors import ConfigError
from xshard.optimizer import LocalReduction, cross_shard_phases
from xshard.slots import has_cross_shard_state


def _is_none(x: Any) -> bool:
    return x is None


def constrain_for_update(layout: ZeroLayout, params: Any, grads: Any) -> tuple[Any, Any]:
    """`params` and the reduced gradient (a tree, or a `LocalReduction`) in the sharded layout.

    Args:
      layout: the run's layout (stage >= 1).
      params: the params as the step received them.
      grads: the reduced gradient, or the `LocalReduction` holding it.

    Returns:
      (params, grads) under sharding constraints: sliced over the data axes where `zero_dim`
      allows, as the update runs on them.
    """
    base = layout.base_shardings(params)
    sharded = layout.sharded(params, base)
    local = grads if isinstance(grads, LocalReduction) else None
    g = local.updates if local is not None else grads
    if layout.stage == 1 and local is None:  # GSPMD: the all-reduce of ZeRO-1, then a slice
        g = jax.lax.with_sharding_constraint(g, base)
    g = jax.lax.with_sharding_constraint(g, sharded)
    params = jax.lax.with_sharding_constraint(params, sharded)
    return params, (dataclasses.replace(local, updates=g) if local is not None else g)


def data_spec(dim: int | None, axes: tuple[str, ...]) -> P:
    """The spec, over the manual data `axes`, of a leaf sliced along `dim` (None: whole)."""
    if dim is None:
        return P()
    return P(*([None] * dim), axes[0] if len(axes) == 1 else axes)


def gather(layout: ZeroLayout, params: Any) -> Any:
    """`params`, sliced over the data axes by `layout`, all-gathered whole: one all-gather per
    dtype (`xshard.buckets.all_gather_tree`: packed on CPU, combined by XLA elsewhere), not one
    per parameter."""
    dims = layout.data_dims(params, layout.base_shardings(params))
    specs = jax.tree.map(lambda d: data_spec(d, layout.axes), dims, is_leaf=_is_none)
    return jax.shard_map(
        lambda p: all_gather_tree(p, dims, layout.axes),
        mesh=layout.mesh,
        in_specs=(specs,),
        out_specs=P(),
        axis_names=set(layout.axes),
    )(params)


def gathered(layout: ZeroLayout, params: Any) -> Any:
    """The params for the forward and backward pass: at stage 3 gathered over the data axes
    (FSDP; otherwise GSPMD may reshard activations instead), else as they are."""
    return gather(layout, params) if layout.stage >= 3 else params


def updated(layout: ZeroLayout, params: Any) -> Any:
    """The new params after the update on slices: gathered at stages 1 and 2 (replicated at
    rest), kept sliced at stage 3."""
    return gather(layout, params) if layout.stage < 3 else params


class ZeroReduced(NamedTuple):
    """The reducing half of a ZeRO step, as global arrays (`manual_zero_step`)."""

    #: The reduced (or reduce-scattered) gradient.
    local: LocalReduction
    #: The new model state, already reduced over the shards.
    model_state: Any
    #: The loss and the task's aux metrics, averaged over the shards.
    metrics: dict[str, jax.Array]


def manual_zero_step(
    layout: ZeroLayout,
    mesh: jax.sharding.Mesh,
    axes: tuple[str, ...],
    levels: Sequence[int],
    reduce_fn: Callable[..., LocalReduction],
    shard_grads: Callable[..., Any],
    level_flags: Callable[..., dict[str, Any]],
) -> Callable[..., ZeroReduced]:
    """The reducing half of a ZeRO step on the manual path.

    Args:
      layout: the run's layout (stage >= 1).
      mesh, axes: the mesh and its data axes (manual in the shard_map).
      levels: the levels the step serves (a traced level when several).
      reduce_fn: the first phase of the cross-shard optimizer (`CrossShardPhases.reduce`).
      shard_grads: ``(params, model_state, batch, rng) -> trainers.core.step.LossAndGrads`` for
        one shard (params replicated, the gradient per shard, the new model state already
        reduced over the shards), run inside the shard_map.
      level_flags: `trainers.core.step.level_flags`.

    Returns:
      ``reduce(params, model_state, batch, rng, level) -> ZeroReduced``.
    """
    traced_level = len(levels) > 1

    def reduce(params, model_state, batch, rng, level):
        dims = layout.scatter_dims(params, layout.base_shardings(params))

        specs = jax.tree.map(lambda d: data_spec(d, axes), dims, is_leaf=_is_none)

        def shard_step(params, model_state, batch, rng, *traced):
            flags = level_flags(traced[0] if traced else levels[0], levels)
            out = shard_grads(params, model_state, batch, rng)
            local = reduce_fn(out.grads, params, with_stats=flags["with_stats"], scatter_dims=dims)
            # Divided here: the reduction leaves the shard_map as the gradient itself.
            local = dataclasses.replace(
                local, updates=local.gradient(), parts=None, mean_over=1, unpack=None
            )
            metrics = {"train/loss": jax.lax.pmean(out.loss, axes)}
            metrics |= {f"train/{k}": jax.lax.pmean(v, axes) for k, v in out.aux.items()}
            return ZeroReduced(local, out.model_state, metrics)

        traced = (level,) if traced_level else ()
        return jax.shard_map(
            shard_step,
            mesh=mesh,
            in_specs=(P(), P(), P(axes), P()) + (P(),) * len(traced),
            out_specs=ZeroReduced(LocalReduction(specs, P(), P()), P(), P()),
            axis_names=set(axes),
        )(params, model_state, batch, rng, *traced)

    return reduce


@dataclasses.dataclass(frozen=True)
class ZeroPhases:
    """The two phases a ZeRO step runs on the manual path.

    Attributes:
      reduce, finish, apply: `xshard.CrossShardPhases` of the optimizer (``own``) or, for a
        plain optax optimizer, of the trainer's own reduction (then the optimizer's update
        follows).
      own: whether they are the optimizer's.
    """

    reduce: Callable[..., LocalReduction]
    finish: Callable[..., Any]
    apply: Callable[..., Any]
    own: bool


def zero_phases(
    tx: optax.GradientTransformation, front: optax.GradientTransformation
) -> ZeroPhases:
    """The phases of `tx` if `cross_shard` made it, else those of `front` (the trainer's
    reduction for a plain optax optimizer)."""
    own = cross_shard_phases(tx)
    if own is not None:
        return ZeroPhases(own.reduce, own.finish, own.apply, True)
    theirs = cross_shard_phases(front)
    assert theirs is not None
    return ZeroPhases(theirs.reduce, theirs.finish, theirs.apply, False)


def check_unwrapped(opt_state: Any) -> None:
    """Refuses an optimizer that holds a `cross_shard` state without being one (a chain around
    it): its reduction cannot be split from its update.

    Raises:
      ConfigError: naming ``sharding.zero_stage``.
    """
    if has_cross_shard_state(opt_state):
        raise ConfigError(
            "sharding.zero_stage>0 with trainer.grad_impl=manual needs the optimizer made by "
            "xshard.cross_shard itself (not wrapped in a chain); use trainer.grad_impl=gspmd, "
            "or sharding.zero_stage=0."
        )
