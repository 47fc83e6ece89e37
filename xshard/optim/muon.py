"""Muon whose Newton-Schulz iterations run on whole matrices, however its state is sharded.

`optax.contrib.muon` orthogonalises each matrix's momentum with Newton-Schulz iterations,
which need the whole matrix. Under ZeRO (``sharding.zero_stage`` >= 1) the momentum is sharded
by rows, and GSPMD partitions the iterations themselves: each of their matrix products becomes
collectives (601 all-gathers and 41 all-reduces per step on an 8-layer GPT, 6.2x the ring
limit). optax has no per-matrix hook, so `muon` here is optax's, built from the same parts
(same arguments, same state tree, same arithmetic), with one change in `scale_by_muon`: the
momentum each matrix orthogonalises is laid out whole (`whole`) first, so it is gathered once
and the iterations run without communication; the update leaves whole. `whole_updates` names
the parameters so updated: a ZeRO step whose params are whole at rest adds the whole update to
the whole parameter and leaves it out of the params' gather. Where the params are sliced at rest
(``zero_stage=3``) the step passes ``muon_owners=N`` (an optax extra argument): each matrix is
orthogonalised by one owner device instead (`owned`), its momentum kept in owner order
(`xshard.optim.muon_owners`: whole on its owner, rows still sliced) and its gradient arriving in
that order (``muon_owned_grads``; else swapped here, an all-to-all), so only the update goes back
to the rows: one all-to-all of 1/N of it in place of a gather of all of it. Where the momentum is
replicated (``zero_stage=0``) the step passes ``muon_spread=<data axes>``: each device
orthogonalises 1/N of the matrices and one all-gather per shape brings the updates to all
(`spread`), instead of every device running the iterations on every matrix; with
``shard_orthogonalization=False`` it does run them all (`whole_each`), which spares the
all-gather (the ring limit, not 1.5x of it) for N times the iterations.

Adapted from optax.contrib._muon (optax 0.2.8, Apache 2.0, DeepMind).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.contrib import _muon as optax_muon  # Newton-Schulz and shape scaling: not exported
from optax.transforms import MaskedNode

from xshard.optim.muon_owners import (
    owned,
    owner_groups,
    swap_order,
    to_owner_order,
    whole,
)

WeightDims = Any  # a MuonDimensionNumbers, a pytree of them (None: Adam), or a callable


def _is_dims(x: Any) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def _is_muon_state(x: Any) -> bool:
    return isinstance(x, MuonState)


def whole_updates(opt_state: Any) -> Any | None:
    """Per parameter, whether a Muon state in `opt_state` holds its momentum: `scale_by_muon`
    lays that parameter's update out whole on every device, so a sharded step can add it to
    the whole parameter and skip the parameter's gather (`trainers.core.step.zero_update`).

    Args:
      opt_state: an optimizer state (any nesting: partitions, chains, injected hyperparams).

    Returns:
      A tree of bools shaped like the params (Muon's momentum, `optax.MaskedNode` where its
      Adam fallback updates), or None if `opt_state` holds no `optax.contrib.MuonState`.
    """
    states = [
        s for s in jax.tree.leaves(opt_state, is_leaf=_is_muon_state) if isinstance(s, MuonState)
    ]
    if not states:
        return None
    masks = [
        jax.tree.map(
            lambda m: not isinstance(m, MaskedNode),
            s.mu,
            is_leaf=lambda m: isinstance(m, MaskedNode),
        )
        for s in states
    ]
    return jax.tree.map(lambda *held: any(held), *masks)


def _momentum(updates: Any, state: MuonState, beta: float, nesterov: bool) -> tuple[Any, Any]:
    """(the new momentum, the momentum to orthogonalise), as `optax.contrib.scale_by_muon`."""
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count_inc = optax.safe_increment(state.count)
    if not nesterov:
        return mu, optax.tree.bias_correction(mu, beta, count_inc)
    mu_hat = jax.tree.map(
        lambda m, g: beta * m + (1 - beta) * g,
        optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
        optax.tree.bias_correction(updates, beta, count_inc),
    )
    return mu, mu_hat


def whole_each(orthogonalize: Callable[..., jax.Array], mu_hat: Any, dims: Any) -> Any:
    """Each matrix of `mu_hat` orthogonalised whole on every device (`whole` before and after
    the iterations): one gather of each matrix, no communication inside the iterations."""
    return jax.tree.map(
        lambda x, d: whole(orthogonalize(whole(x), dimension_numbers=d)),
        mu_hat,
        dims,
        is_leaf=_is_dims,
    )


def _canonical(x: jax.Array) -> jax.Array:
    """A 2-D matrix with no more rows than columns (transposed if taller), the orientation
    `optax.contrib`'s Newton-Schulz iterates in: ``orthogonalize(x) == orthogonalize(x.T).T``."""
    return x.T if x.ndim == 2 and x.shape[0] > x.shape[1] else x


def spread(
    orthogonalize: Callable[..., jax.Array], mu_hat: Any, dims: Any, axes: tuple[str, ...]
) -> Any:
    """Each matrix of `mu_hat`, whole on every device of `axes` (a replicated momentum),
    orthogonalised by one of them and its update gathered whole (one all-gather per group):
    each device runs the iterations on 1/N of the matrices, not on all of them (the
    distributed Muon of Jordan et al. 2024 under data parallelism). The matrices are grouped
    by shape (2-D ones transposed to `_canonical`), each group padded with zero matrices to a
    multiple of N (their iterations give zeros) and split in N blocks: device k takes block k
    (``axis_index``) and an ``all_gather`` returns them all, in the step's ``shard_map`` where
    `axes` are manual, in one of its own where not (GSPMD, left to place the blocks by sharding
    constraints, turned the stacking into all-to-alls). Without a mesh, with no axes, or with
    other axes manual: `whole_each`."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes) if not mesh.empty else set()
    in_manual = bool(axes) and set(axes) <= manual
    if mesh.empty or not axes or (manual and not in_manual):
        return whole_each(orthogonalize, mu_hat, dims)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    leaves, treedef = jax.tree.flatten(mu_hat)
    dims_leaves = treedef.flatten_up_to(dims)  # type: ignore[attr-defined]  # jaxlib: no stubs
    out = list(leaves)
    groups: dict[Any, list[int]] = {}
    for i, (x, d) in enumerate(zip(leaves, dims_leaves)):
        if _is_dims(d):
            groups.setdefault((_canonical(x).shape, x.dtype, d), []).append(i)
    for (shape, dtype, d), members in groups.items():
        pad = [jnp.zeros(shape, dtype)] * (-len(members) % n)
        stack = jnp.stack([_canonical(leaves[i]) for i in members] + pad)
        ortho = jax.vmap(lambda x, d=d: orthogonalize(x, dimension_numbers=d))

        def mine(stack: jax.Array, ortho: Callable[..., jax.Array] = ortho) -> jax.Array:
            """Block k (of N) on device k, gathered back whole and replicated."""
            block = stack.reshape(n, -1, *stack.shape[1:])[jax.lax.axis_index(axes)]
            return jax.lax.all_gather(ortho(block), axes, to="invarying").reshape(stack.shape)

        if not in_manual:  # the same program, in a shard_map of its own
            mine = jax.shard_map(mine, in_specs=P(), out_specs=P(), axis_names=set(axes))
        done = mine(stack)
        for k, i in enumerate(members):
            out[i] = done[k].T if done[k].shape != leaves[i].shape else done[k]
    return jax.tree.unflatten(treedef, out)


def _adaptive(mu_hat: Any, out: Any) -> Any:
    """`out` scaled by the dual norm of the momentum (arXiv 2409.20325), as optax's."""
    return jax.tree.map(lambda x, y: jnp.sum(x.conj() * y) * y, mu_hat, out)


def scale_by_muon(
    ns_coeffs: Any = optax_muon._DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers: WeightDims = None,
    shard_orthogonalization: bool = True,
) -> optax.GradientTransformation:
    """`optax.contrib.scale_by_muon`, each matrix orthogonalised whole (`whole`).

    Args:
      ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov, adaptive, preconditioning,
        weight_dimension_numbers: as `optax.contrib.scale_by_muon`'s.
      shard_orthogonalization: whether ``muon_spread`` is taken (`spread`); False: a
        replicated momentum is orthogonalised whole on every device (`whole_each`).

    Returns:
      The transformation; its state is `optax.contrib.MuonState`, as optax's. Its update
      takes the extra arguments ``muon_owners`` (N > 0: `owned`, for a momentum sliced by
      rows and kept in owner order over N devices, `xshard.optim.muon_owners`; with
      ``muon_owned_grads`` the gradient comes in owner order too, else it is swapped here) and
      ``muon_spread`` (mesh axes: `spread`, for a replicated momentum, unless
      `shard_orthogonalization` is False); neither: `whole_each`.
    """
    optax_tx = optax.contrib.scale_by_muon(
        ns_coeffs,
        ns_steps,
        beta,
        eps,
        mu_dtype,
        nesterov=nesterov,
        adaptive=adaptive,
        preconditioning=preconditioning,
        weight_dimension_numbers=weight_dimension_numbers,
    )
    mu_dtype = optax_muon.utils.canonicalize_dtype(mu_dtype)

    def update_fn(
        updates: Any,
        state: MuonState,
        params: Any = None,
        *,
        muon_owners: int = 0,
        muon_owned_grads: bool = False,
        muon_spread: tuple[str, ...] = (),
        **extra_args: Any,
    ) -> tuple[Any, MuonState]:
        del params, extra_args
        dims = weight_dimension_numbers
        dims = dims(updates) if callable(dims) else dims
        groups = owner_groups(state.mu, muon_owners)
        if not muon_owned_grads:  # the momentum is in owner order, not the gradient
            updates = to_owner_order(updates, groups)
        mu, mu_hat = _momentum(updates, state, beta, nesterov)
        orthogonalize = functools.partial(
            optax_muon.orthogonalize_via_newton_schulz,
            ns_coeffs=state.ns_coeffs,
            ns_steps=ns_steps,
            preconditioning=preconditioning,
            eps=eps,
        )
        if muon_owners:
            out = owned(orthogonalize, mu_hat, dims, groups)
        elif muon_spread and shard_orthogonalization:
            out = spread(orthogonalize, mu_hat, dims, muon_spread)
        else:
            out = whole_each(orthogonalize, mu_hat, dims)
        if adaptive:
            out = _adaptive(swap_order(mu_hat, groups), out)  # in row order, as `out`
        count = optax.safe_increment(state.count)
        return out, MuonState(count, optax.tree.cast(mu, mu_dtype), state.ns_coeffs)

    return optax.GradientTransformationExtraArgs(optax_tx.init, update_fn)


def _labels_and_dims(dims_or_fn: WeightDims) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(params -> "muon"/"adam" label per leaf, params -> dimension numbers with
    `optax.MaskedNode` where Adam's leaves are): `optax.contrib.muon`'s partition."""
    if dims_or_fn is None:  # optax's default: Muon for every 2-D parameter

        def labels(params: Any) -> Any:
            return jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)

        dims_or_fn = MuonDimensionNumbers()
    else:

        def labels(params: Any) -> Any:
            dims = dims_or_fn(params) if callable(dims_or_fn) else dims_or_fn
            return jax.tree.map(
                lambda d, x: jax.tree.map(lambda _: "adam" if d is None else "muon", x),
                dims,
                params,
                is_leaf=lambda x: x is None or _is_dims(x),
            )

    def dims_fn(params: Any) -> Any:
        dims = dims_or_fn(params) if callable(dims_or_fn) else dims_or_fn
        mask = jax.tree.map(lambda label: label == "muon", labels(params))
        return jax.tree.map(
            lambda d, sub: jax.tree.map(lambda m: d if m else MaskedNode(), sub),
            dims,
            mask,
            is_leaf=lambda x: x is None or _is_dims(x) or isinstance(x, MaskedNode),
        )

    return labels, dims_fn


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = optax_muon._DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: WeightDims = None,
    consistent_rms: float | None = None,
    shard_orthogonalization: bool = True,
) -> optax.GradientTransformation:
    """`optax.contrib.muon` (same arguments, state and arithmetic) whose Newton-Schulz
    iterations run on whole matrices (`scale_by_muon`): under a sharded state each matrix's
    momentum is gathered once, not the iterations partitioned.

    Args:
      learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, weight_decay_mask,
        mu_dtype, nesterov, adaptive, preconditioning, adam_b1, adam_b2, adam_eps_root,
        adam_weight_decay, adam_learning_rate, muon_weight_dimension_numbers,
        consistent_rms: as `optax.contrib.muon`'s.
      shard_orthogonalization: where the momentum is replicated (``sharding.zero_stage=0``),
        each device orthogonalises 1/N of the matrices and an all-gather shares the updates
        (True, `spread`), or every device orthogonalises every matrix (False: no all-gather,
        N times the iterations); `scale_by_muon`'s.

    Returns:
      The optimizer: a partition of Muon (the parameters `muon_weight_dimension_numbers`
      names; default every 2-D one) and AdamW (the others).
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in optax_muon._NS_COEFFS_PRESET_DICT:
            raise ValueError(f"Unknown ns_coeff preset string: {ns_coeffs}")
        ns_coeffs = optax_muon._NS_COEFFS_PRESET_DICT[ns_coeffs]
    labels, dims_fn = _labels_and_dims(muon_weight_dimension_numbers)
    muon_half = optax.chain(
        scale_by_muon(
            ns_coeffs,
            ns_steps,
            beta,
            eps,
            mu_dtype,
            nesterov=nesterov,
            adaptive=adaptive,
            preconditioning=preconditioning,
            weight_dimension_numbers=dims_fn,
            shard_orthogonalization=shard_orthogonalization,
        ),
        optax_muon.scale_by_shape(dims_fn, consistent_rms),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam_half = optax.adamw(
        learning_rate=learning_rate if adam_learning_rate is None else adam_learning_rate,
        b1=adam_b1,
        b2=adam_b2,
        eps=eps,
        eps_root=adam_eps_root,
        weight_decay=adam_weight_decay,
        mu_dtype=mu_dtype,
        nesterov=nesterov,
    )
    return optax.partition({"muon": muon_half, "adam": adam_half}, labels)
