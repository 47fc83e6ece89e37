"""Periodic sync over one mesh axis (local SGD, DiLoCo, Streaming DiLoCo): the outer step.

Replicas over a *periodic* axis train alone (their every-step reduction leaves the axis out);
every ``every_steps`` steps a sync step, run inside ``jax.shard_map`` with the axis manual:

1. pseudo-gradient of each replica: ``delta = outer_params - replica_params`` (DiLoCo's outer
   gradient; with error feedback the codec's residual of the last sync is added to it);
2. reduced over the axis (``rule: mean``) hierarchically (`xshard.reduce.hierarchical`): each device
   of a replica reduces its ``1 / F`` share of it over the axis, in one all-reduce or through
   the axis's codec (``comm_dtype``, `xshard.reduce.compressed.compressed_all_reduce`) when one is
   set, and the shares are all-gathered within the replica; with ``error_feedback`` each device
   keeps its share's codec residual;
3. non-finite guard: the reduced pseudo-gradient is the same on every replica, so a NaN/Inf in
   it makes every replica skip the sync alike (outer params, outer state and residuals are
   kept; every replica restarts from the kept outer params, dropping the diverged local steps);
4. the outer optax optimizer: ``updates, state = outer.update(mean_delta, state, params)``,
   ``outer_params += updates``. ``optax.sgd(1.0)`` gives ``outer - mean(outer - replica) =
   mean(replica)``: parameter averaging (local SGD); Nesterov SGD gives DiLoCo;
5. every replica restarts from the new outer params.

Fragments (Streaming DiLoCo): the parameter leaves are split into ``fragments`` contiguous
groups of about equal size (`fragment_leaves`), each with its own outer optimizer state and
synced on its own step of the period (`due_fragment`): the traffic of a sync is spread over
the period. With one fragment this is plain periodic sync.

Delay and mixing (Streaming DiLoCo, Douillard et al. 2025; ``sync_delay`` tau, ``mix``
alpha): at a fragment's sync step t each replica *sends* its pseudo-gradient (step 1,
`send_fragment`: written into the state, ``OuterState.pending``); the replicas go on training
for tau more steps; after step t + tau steps 2-4 run on the sent value (`sync_fragment` with
``sent``), and step 5 becomes ``replica = alpha * replica(t + tau) + (1 - alpha) * outer``
(on a skipped sync every replica still restarts from the kept outer params). The collective
reads only what was sent at t: nothing of it depends on the tau inner steps. tau = 0 and
alpha = 0 is the sync above, the same program.

Every array here is a list of the fragment's parameter leaves (flatten order), so one outer
optimizer state per fragment holds exactly its leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xshard.config.axes import AxisRule
from xshard.reduce.compressed import tree_size
from xshard.reduce.hierarchical import hierarchical_all_reduce, share_size, slow_bytes_sent
from xshard.stats.tree import tree_sq_norm


class OuterState(NamedTuple):
    """The state a periodic axis adds: per fragment, the outer params (a list of leaves), the
    outer optimizer's state and the error-feedback residual (per replica, a float32 row per
    device of the replica for its share: `xshard.reduce.hierarchical`; None without error
    feedback); with a ``sync_delay``, the pseudo-gradient each replica sent at the fragment's
    last sync step (a list of leaves like the replicas', `send_fragment`), else None."""

    params: tuple[list[jax.Array], ...]
    opt_state: tuple[Any, ...]
    residual: tuple[Any, ...]
    pending: tuple[Any, ...] | None = None


class SyncStats(NamedTuple):
    """A sync step's statistics, the same on every replica (TensorBoard ``sync/<axis>/*``)."""

    pseudo_grad_norm: jax.Array  # |mean over replicas of (outer - replica)|
    outer_update_norm: jax.Array  # |what the outer optimizer added to the outer params|
    replica_drift: jax.Array  # RMS over replicas of |replica - outer| before the sync
    compression_error_norm: jax.Array  # RMS over replicas of the codec's error (0: none)
    skipped: jax.Array  # 1.0 if the pseudo-gradient was non-finite and the sync skipped


class Synced(NamedTuple):
    """A fragment's sync: its new outer state entries, the replicas' new leaves, statistics."""

    params: list[jax.Array]
    opt_state: Any
    residual: Any
    replica: list[jax.Array]
    stats: SyncStats


def fragment_leaves(sizes: Sequence[int], fragments: int) -> tuple[tuple[int, ...], ...]:
    """Splits leaves (by their element counts `sizes`, in flatten order) into `fragments`
    contiguous groups of about equal total size, each non-empty.

    Raises:
      ValueError: if there are fewer leaves than fragments.
    """
    if fragments > len(sizes):
        raise ValueError(f"{fragments} fragments need at least as many leaves, not {len(sizes)}.")
    total, groups, start, done = sum(sizes), [], 0, 0
    for f in range(fragments):
        end = start + 1
        target = total * (f + 1) / fragments
        done += sizes[start]
        # Take leaves while below the target and enough remain for the other fragments.
        while end < len(sizes) - (fragments - f - 1) and done + sizes[end] / 2 <= target:
            done += sizes[end]
            end += 1
        if f == fragments - 1:
            end = len(sizes)
        groups.append(tuple(range(start, end)))
        start = end
    return tuple(groups)


def due_fragment(step: int, rule: AxisRule) -> int | None:
    """The fragment a periodic axis syncs after update `step` (1-based), or None.

    Fragment ``f`` syncs when ``(step - warmup_steps) % every_steps`` equals its offset
    ``((f + 1) * every_steps // fragments) % every_steps``: fragments are staggered evenly
    over the period, the last on the period's end (with one fragment: every ``every_steps``
    steps after the warm-up). No sync during the warm-up.
    """
    local = step - rule.warmup_steps
    if local <= 0:
        return None
    phase = local % rule.every_steps
    for f in range(rule.fragments):
        if phase == ((f + 1) * rule.every_steps // rule.fragments) % rule.every_steps:
            return f
    return None


def due_update(step: int, rule: AxisRule) -> int | None:
    """The fragment whose outer update runs after update `step`, or None: the one sent
    ``sync_delay`` steps before (`due_fragment`; with no delay, the one due now)."""
    return due_fragment(step - rule.sync_delay, rule)


def init_outer(
    rule: AxisRule,
    leaves: list[jax.Array],
    groups: tuple[tuple[int, ...], ...],
    replicas: int,
    inner: int = 1,
) -> OuterState:
    """The outer state for the parameter `leaves` (of one replica), split by `groups`.

    The residuals (with ``error_feedback``) are ``(replicas, inner) + (share,)``: each device
    of each replica keeps its share's (`residual_shape`; `inner`: the devices of a replica).
    With a ``sync_delay``, what each replica sent: zeros ``(replicas,) + leaf shape``.
    """
    params = tuple([leaves[i] for i in g] for g in groups)
    opt = tuple(rule.outer_optimizer.init(p) for p in params)
    residual = tuple(
        jnp.zeros((replicas, *residual_shape(p, replicas, inner, rule)), jnp.float32)
        if rule.error_feedback
        else None
        for p in params
    )
    if not rule.sync_delay:
        return OuterState(params, opt, residual)
    pending = tuple([jnp.zeros((replicas, *x.shape), x.dtype) for x in p] for p in params)
    return OuterState(params, opt, residual, pending)


def residual_shape(
    leaves: Sequence[Any], replicas: int, inner: int, rule: AxisRule
) -> tuple[int, int]:
    """One replica's error-feedback residuals for `leaves`: a row per device of the replica
    (`inner` of them), each its share's (`xshard.reduce.hierarchical.share_size`)."""
    return inner, share_size(tree_size(leaves), replicas, inner, rule.comm_dtype or "float32")


def bytes_per_sync(leaves: Sequence[Any], replicas: int, inner: int, rule: AxisRule) -> int:
    """Bytes one device sends over the axis to sync `leaves`: its share, in the params' dtype
    or its codec's (`xshard.reduce.hierarchical.slow_bytes_sent`)."""
    itemsize = np.dtype(jnp.result_type(*leaves)).itemsize if leaves else 4
    codec = rule.comm_dtype or "float32"
    return slow_bytes_sent(tree_size(leaves), replicas, inner, codec, itemsize)


def send_fragment(outer_params: list[jax.Array], replica: list[jax.Array]) -> list[jax.Array]:
    """What a replica sends at a fragment's sync step: its pseudo-gradient ``outer - replica``
    (the codec's residual is added when it is reduced). Elementwise: the outer params may be
    one replica's and `replica` the replicas' with their leading dimension."""
    return [o - r for o, r in zip(outer_params, replica, strict=True)]


def sync_fragment(
    rule: AxisRule,
    axis: str,
    outer_params: list[jax.Array],
    opt_state: Any,
    residual: Any,
    replica: list[jax.Array],
    inner_axes: tuple[str, ...] = (),
    sent: list[jax.Array] | None = None,
) -> Synced:
    """One fragment's sync, inside ``shard_map`` with `axis` manual (module docstring).

    Args:
      rule: the axis's rule (its ``outer_optimizer``, ``mix``).
      axis: the periodic mesh axis.
      outer_params: the fragment's outer params (the same on every replica).
      opt_state: the fragment's outer optimizer state.
      residual: this replica's error-feedback residuals (`residual_shape`), or None.
      replica: this replica's params of the fragment.
      inner_axes: the mesh axes of a replica (not manual), whose devices each reduce a share
        of the pseudo-gradient (`xshard.reduce.hierarchical`); empty: each reduces all of it.
      sent: the pseudo-gradient this replica sent ``sync_delay`` steps before
        (`send_fragment`); None: the one of `replica`, now.

    Returns:
      The `Synced` fragment; its ``replica`` leaves are ``mix * replica + (1 - mix) *
      params`` (its ``params`` with ``mix`` 0 or a skipped sync), varying over `axis`, as
      the replicas' params are.
    """
    delta = send_fragment(outer_params, replica) if sent is None else sent
    drift_sq = tree_sq_norm(delta)
    reduced = hierarchical_all_reduce(
        delta,
        axis,
        inner_axes,
        comm_dtype=rule.comm_dtype,
        residual=residual,
        extra=drift_sq[None],
    )
    mean, new_residual, error_sq = reduced.value, reduced.residual, reduced.error_sq
    drift_sq = reduced.extra[0]
    ok = jnp.isfinite(tree_sq_norm(mean))  # the same on every replica: after the reduction
    updates, new_opt = rule.outer_optimizer.update(mean, opt_state, outer_params)
    new_params = optax.apply_updates(outer_params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    new_params, new_opt = keep(new_params, outer_params), keep(new_opt, opt_state)
    if residual is not None:
        new_residual = keep(new_residual, residual)
    stats = SyncStats(
        pseudo_grad_norm=jnp.sqrt(tree_sq_norm(mean)),
        outer_update_norm=jnp.where(ok, jnp.sqrt(tree_sq_norm(updates)), 0.0),
        replica_drift=jnp.sqrt(drift_sq),
        compression_error_norm=jnp.sqrt(error_sq),
        skipped=jnp.where(ok, 0.0, 1.0),
    )
    back = [jax.lax.pcast(p, axis, to="varying") for p in new_params]
    if rule.mix:  # else exactly the outer params (the sync without mixing, bitwise)
        mixed = [
            (rule.mix * r + (1.0 - rule.mix) * p).astype(r.dtype)
            for r, p in zip(replica, back, strict=True)
        ]
        back = [jnp.where(ok, m, b) for m, b in zip(mixed, back, strict=True)]
    return Synced(new_params, new_opt, new_residual, back, stats)
