"""The train step's ZeRO parts (`trainers.core.zero`): where the gradient is reduced, and the
sharding constraints that make GSPMD run the optimizer on each device's slice.

* ``grad_impl=manual``: the shard_map computes each shard's gradient and runs the first phase
  of the cross-shard optimizer there (per-shard clip, local statistics, the reduction: an
  all-reduce at stage 1, at stages 2 and 3 one reduce-scatter per dtype,
  `xshard.CrossShardPhases`, `xshard.mesh.collectives`); the second phase (summary, non-finite
  guard, inner optimizer) runs outside it, under GSPMD, on the slices. Microbatches accumulate
  locally and are reduced once.
* ``grad_impl=gspmd``: the compiler reduces the gradient; constraining it to the sharded layout
  asks for a reduce-scatter (stages 2 and 3), or an all-reduce then a slice (stage 1).

In both, the params are constrained to the sharded layout for the update (a local slice at
stages 1 and 2, already so at stage 3), so the update is computed on 1/N of every array; the
new params are then all-gathered (stages 1 and 2), or kept sliced and gathered for the next
forward pass (stage 3), one all-gather per dtype (`gather`). A param the optimizer updates
whole (Muon's matrices: `xshard.optim.muon.whole_updates`) stays whole for the update at stages
1 and 2 and is left out of that gather: its new value is already whole on every device; at
stage 3 one owner per matrix orthogonalises it (`owner_args`; at stage 0 too, its update then
gathered), Muon's momentum kept in owner order and its gradient swapped to that order before the
reduce-scatter on the manual path (`owner_order`), so that each owner receives its matrices'
gradient whole. A norm
over a sharded array is a global norm under GSPMD, which keeps lamb, lars, adafactor and
global-norm clipping exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from trainers.core.zero import ZeroLayout
from xshard.mesh.collectives import all_gather_tree
from xshard.optim.cross_shard import LocalReduction
from xshard.optim.muon_owners import muon_groups, swap_order
from xshard.reduce.per_axis import state_partition_specs


def _is_none(x: Any) -> bool:
    return x is None


def _pick(whole: bool, at_whole: Any, sliced: Any) -> Any:
    return at_whole if whole else sliced


def whole_at_rest(layout: ZeroLayout, whole: Any) -> Any:
    """`whole` (`xshard.optim.muon.whole_updates`: the params the optimizer updates whole),
    or None where the params are sliced at rest (stage 3), so every param is updated sliced."""
    return whole if layout.stage < 3 else None


def owners(layout: ZeroLayout | None, replicas: bool = False) -> int:
    """N, the number of devices that own Muon's matrices and hold its momentum in owner order
    (`xshard.optim.muon_owners`): the mesh's at stage 3 (params sliced at rest), 0 (row order)
    at other stages, on one device, or in a periodic axis's `replicas` (whose step sees that
    axis manual: each matrix is orthogonalised whole there)."""
    if layout is None or layout.stage < 3 or replicas or layout.mesh.size <= 1:
        return 0
    return layout.mesh.size


def owner_args(
    layout: ZeroLayout | None, whole: Any, n_owners: int = 0, owned_grads: bool = False
) -> dict[str, Any]:
    """The optimizer's extra arguments for the update, where it updates some params whole
    (`whole`: Muon's matrices): each matrix is orthogonalised by one owner rather than on every
    device. Stage 0 (a replicated momentum): each device orthogonalises 1/N of the matrices and
    an all-gather brings their updates to all (``muon_spread``, `xshard.optim.muon.spread`);
    stage 3 (params sliced at rest): the momentum is in owner order over `n_owners` (`owners`)
    and the owner's update goes back to the row slices (``muon_owners``,
    `xshard.optim.muon.owned`), the gradient already in owner order where `owned_grads`
    (`owner_order`); none otherwise."""
    if layout is None or whole is None:
        return {}
    if layout.stage == 0:
        return {"muon_spread": layout.axes}
    if layout.stage < 3:
        return {}
    return {"muon_owners": n_owners, "muon_owned_grads": owned_grads}


def owner_order(layout: ZeroLayout | None, opt_state: Any, n_owners: int, per_leaf: bool) -> Any:
    """The groups of Muon's matrices (`xshard.optim.muon_owners.owner_groups` over `n_owners`)
    whose gradient the step swaps to owner order before reducing it, so that the
    reduce-scatter delivers each matrix's gradient whole to its owner: where the data axes are
    the whole mesh (the owners its data shards), unless the step measures or reduces the
    gradient per leaf (`per_leaf`: per-layer norms, histograms, per-axis rules), in row order.
    [] for none (the optimizer then swaps the gradient itself)."""
    if not n_owners or per_leaf or layout is None or layout.num_shards != n_owners:
        return []
    return muon_groups(opt_state, n_owners) or []


def constrain_for_update(
    layout: ZeroLayout, params: Any, grads: Any, whole: Any = None
) -> tuple[Any, Any]:
    """`params` and the reduced gradient (a tree, or a `LocalReduction`) in the sharded layout.

    Args:
      layout: the run's layout (stage >= 1).
      params: the params as the step received them.
      grads: the reduced gradient, or the `LocalReduction` holding it.
      whole: per param, whether the optimizer updates it whole (`whole_at_rest`), or None.

    Returns:
      (params, grads) under sharding constraints: sliced over the data axes where `zero_dim`
      allows, as the update runs on them; a param updated whole stays as it is.
    """
    base = layout.base_shardings(params)
    sharded = layout.sharded(params, base)
    p_sharded = sharded if whole is None else jax.tree.map(_pick, whole, base, sharded)
    local = grads if isinstance(grads, LocalReduction) else None
    g = local.updates if local is not None else grads
    if layout.stage == 1 and local is None:  # GSPMD: the all-reduce of ZeRO-1, then a slice
        g = jax.lax.with_sharding_constraint(g, base)
    g = jax.lax.with_sharding_constraint(g, sharded)
    params = jax.lax.with_sharding_constraint(params, p_sharded)
    return params, (dataclasses.replace(local, updates=g) if local is not None else g)


def data_spec(dim: int | None, axes: tuple[str, ...]) -> P:
    """The spec, over the manual data `axes`, of a leaf sliced along `dim` (None: whole)."""
    if dim is None:
        return P()
    return P(*([None] * dim), axes[0] if len(axes) == 1 else axes)


def gather(layout: ZeroLayout, params: Any, whole: Any = None) -> Any:
    """`params`, sliced over the data axes by `layout`, all-gathered whole: one all-gather per
    dtype (`xshard.mesh.collectives.all_gather_tree`: packed on CPU, combined by XLA elsewhere), not
    one per parameter. Those `whole` marks (None: none) are whole already and not gathered."""
    dims = layout.data_dims(params, layout.base_shardings(params))
    if whole is not None:
        dims = jax.tree.map(lambda w, d: None if w else d, whole, dims, is_leaf=_is_none)
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


def updated(layout: ZeroLayout, params: Any, whole: Any = None) -> Any:
    """The new params after the update on slices: gathered at stages 1 and 2 (replicated at
    rest) but for those updated `whole` (`whole_at_rest`), kept sliced at stage 3."""
    return gather(layout, params, whole) if layout.stage < 3 else params


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
    with_stats: bool,
    reduce_fn: Callable[..., LocalReduction],
    shard_grads: Callable[..., Any],
    whole: bool = False,
    updated_whole: Any = None,
    owners: list[list[int]] | None = None,
) -> Callable[..., ZeroReduced]:
    """The reducing half of a ZeRO step on the manual path.

    Args:
      layout: the run's layout (stage >= 1).
      mesh: the mesh.
      axes: its data axes (manual in the shard_map).
      with_stats: whether the step's level takes the statistics
        (`trainers.core.step.levels.LevelFlags`).
      reduce_fn: the first phase of the cross-shard optimizer (`CrossShardPhases.reduce`).
      shard_grads: ``(params, model_state, batch, rng) -> LossAndGrads``
        (`trainers.core.step.grads`) for one shard (params replicated, the gradient per
        shard, the new model state already reduced over the shards), run inside the
        shard_map.
      whole: reduce the gradient whole at every stage, as stage 1 does (the update's
        constraints then slice it): for every-step axis rules (`xshard.reduce.per_axis`), which
        share their reduction out by their own shares, not by the ZeRO slices.
      updated_whole: per param, whether the optimizer updates it whole (`whole_at_rest`), or
        None: such a gradient is reduce-scattered at stage 1 too, only the momentum built
        from it being needed whole (the all-reduce would send it twice over).
      owners: the groups of matrices whose gradient is swapped to owner order before the
        reduction (`owner_order`; each shard holds its whole gradient: no communication).

    Returns:
      ``reduce(params, model_state, batch, rng, comm) -> ZeroReduced``, `comm` the
      cross-shard state's ``comm`` field (the axis rules' residuals; None without rules).
    """

    def reduce(params, model_state, batch, rng, comm=None) -> ZeroReduced:
        base = layout.base_shardings(params)
        dims = layout.scatter_dims(params, base)
        if updated_whole is not None:
            dims = jax.tree.map(_pick, updated_whole, layout.data_dims(params, base), dims)
        if whole:
            dims = jax.tree.map(lambda _: None, dims, is_leaf=_is_none)
        specs = jax.tree.map(lambda d: data_spec(d, axes), dims, is_leaf=_is_none)
        comm_specs = None if comm is None else state_partition_specs(comm)

        def shard_step(params, model_state, batch, rng, comm) -> ZeroReduced:
            out = shard_grads(params, model_state, batch, rng)
            grads = swap_order(out.grads, owners) if owners else out.grads
            local = reduce_fn(grads, params, with_stats=with_stats, scatter_dims=dims, comm=comm)
            # Divided here: the reduction leaves the shard_map as the gradient itself.
            local = dataclasses.replace(
                local, updates=local.gradient(), parts=None, mean_over=1, unpack=None
            )
            metrics = {"train/loss": jax.lax.pmean(out.loss, axes)}
            metrics |= {f"train/{k}": jax.lax.pmean(v, axes) for k, v in out.aux.items()}
            return ZeroReduced(local, out.model_state, metrics)

        return jax.shard_map(
            shard_step,
            mesh=mesh,
            in_specs=(P(), P(), P(axes), P(), comm_specs),
            # Specs in place of values: a pytree prefix of the result's structure.
            out_specs=ZeroReduced(
                LocalReduction(specs, P(), P(), None, comm_specs),  # type: ignore[arg-type]
                P(),
                P(),  # type: ignore[arg-type]  # specs in place of arrays
            ),
            axis_names=set(axes),
        )(params, model_state, batch, rng, comm)

    return reduce
