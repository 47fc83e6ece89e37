"""A periodic mesh axis in the trainer (local SGD, DiLoCo): replicas, the inner and sync programs.

**Representation.** Over the periodic axis (e.g. ``slice``, of size S) each replica holds its
own params, so every replica array — params, the inner optimizer's state, the error-feedback
residuals — has a **leading dimension of S sharded over the axis**: ``P(axis, *spec)`` where
``spec`` is the array's sharding within a replica (the task's model-axis rules, and with ZeRO
the inner data axes). The outer state (`xshard.reduce.periodic.OuterState`: outer params and the
outer optimizer's state) has no such dimension: it is the same on every replica, sharded like
the params within a replica (over the inner data axes too with ZeRO stage >= 1). Why a leading
dimension rather than arrays that are merely "varying" over the axis: a global ``jax.Array``
with a sharding replicated over ``slice`` promises equal copies (a checkpoint would save one
of them, ``device_get`` would read one); a sharded leading dimension is an honest global
array that Orbax saves and restores whole, on one process or several.

**The inner program** is the synchronous train step of one replica (`trainers.core.step`,
ZeRO included) inside a ``jax.shard_map`` manual over the periodic axis: each replica runs it
on its slice of the batch and its own block of the state (the leading dimension squeezed),
with its own reduction over the inner data axes only. Its step functions are built on
`replica_mesh` (the mesh with the periodic axis manual), so their own ``shard_map``s and
sharding constraints live inside. Nothing in it crosses the periodic axis: its metrics come
out per replica (a row each) and the host averages them (`trainers.core.metrics`). Only with
several processes does the stop vote (one int) cross it.

**The sync program** (one per fragment) is `xshard.reduce.periodic.sync_fragment` inside a
``shard_map`` manual over the axis: one all-reduce over the axis per device, of its
``1 / F`` share of the pseudo-gradient (F: the devices of a replica, over `inner_axes`), then
an all-gather of the shares within the replica (`xshard.reduce.hierarchical`). Two compiled
programs, not a traced branch: the HLO of each shows what crosses the axis.

**With a delay** (``sync_delay`` tau > 0), a fragment's sync is two programs: the send
program at its sync step t writes each replica's pseudo-gradient into the state
(``OuterState.pending``, sharded like the replicas' params; no collective), and the sync
program after step t + tau reduces that (the collective reads nothing the tau inner steps
wrote), applies the outer optimizer and mixes (``mix``). A checkpoint inside the window saves
what was sent.

The inner optimizer's state stays per replica across syncs (DiLoCo keeps each worker's AdamW
state); only the params restart from the outer params (mixed with their own with ``mix``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.step.types import TrainState
from xshard.config.axes import AxisRule
from xshard.errors import ConfigError
from xshard.optim.cross_shard import CrossShardTransformation, over_axes
from xshard.optim.schedule_free import eval_params
from xshard.reduce.hierarchical import residual_spec
from xshard.reduce.periodic import (
    OuterState,
    SyncStats,
    bytes_per_sync,
    init_outer,
    send_fragment,
    sync_fragment,
)

#: The TensorBoard tag of a sync step's `xshard.reduce.periodic.SyncStats` field: ``{series}`` is
#: the axis, or with several fragments ``<axis>/fragment_<k>`` (a series per fragment).
SYNC_TAG = "sync/{series}/{name}"
BYTES_TAG = "comm/{axis}/bytes_per_step"


def is_sync_tag(tag: str, axis: str) -> bool:
    """Whether `tag` is one a sync step of the periodic `axis` adds to the step's metrics
    (`SYNC_TAG`, `BYTES_TAG`)."""
    return tag.startswith(f"sync/{axis}/") or tag == BYTES_TAG.format(axis=axis)


def _squeeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _expand(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


@dataclasses.dataclass(frozen=True)
class Periodic:
    """One periodic axis of a run: its rule and where its arrays live.

    Attributes:
      mesh: the device mesh.
      axis: the periodic axis.
      rule: its `xshard.AxisRule` (``outer_optimizer`` set).
    """

    mesh: Mesh
    axis: str
    rule: AxisRule

    def in_warmup(self, step: int) -> bool:
        """Whether update `step` (1-based) is a synchronous warm-up step (``warmup_steps``)."""
        return step <= self.rule.warmup_steps

    def warmup_tx(
        self, tx: CrossShardTransformation, grad_impl: str, zero_stage: int
    ) -> CrossShardTransformation:
        """The optimizer of the warm-up steps: `tx` reducing over the periodic axis too
        (`xshard.optim.cross_shard.over_axes`), so that a warm-up step is the synchronous step of
        ``reduction=mean`` over every data axis, and the replicas stay equal.

        Raises:
          ConfigError: with ``trainer.grad_impl=gspmd`` (the warm-up reduces per-shard
            gradients over the axis) or a ZeRO stage (its layout slices over the other axes).
        """
        key = f"reduction.axes.{self.axis}.warmup_steps={self.rule.warmup_steps}"
        if grad_impl != "manual":
            raise ConfigError(
                f"{key}: warm-up steps reduce per-shard gradients over {self.axis!r}, which "
                f"trainer.grad_impl={grad_impl!r} does not compute; use trainer.grad_impl=manual "
                "or warmup_steps=0."
            )
        if zero_stage:
            raise ConfigError(
                f"{key}: warm-up steps run with sharding.zero_stage=0 only (got {zero_stage}): "
                f"the ZeRO layout slices over the data axes within a replica, not over "
                f"{self.axis!r}; use zero_stage=0 or warmup_steps=0."
            )
        shards = tx.spec.num_shards
        return over_axes(
            tx,
            (self.axis, *tx.spec.axis_name),
            num_shards=None if shards is None else shards * self.replicas,
        )

    def start(self, state: TrainState, groups: tuple[tuple[int, ...], ...]) -> TrainState:
        """The switch from the warm-up to local steps: the outer params become the replicas'
        params (equal on every replica after synchronous steps: replica 0's are taken)."""
        leaves = [x[0] for x in jax.tree.leaves(state.params)]
        params = tuple([leaves[i] for i in g] for g in groups)
        return state._replace(outer=state.outer._replace(params=params))

    @property
    def replicas(self) -> int:
        """S: the number of replicas (the axis's size)."""
        return int(self.mesh.shape[self.axis])

    @property
    def inner_axes(self) -> tuple[str, ...]:
        """The mesh axes of a replica: every axis but the periodic one."""
        return tuple(a for a in self.mesh.axis_names if a != self.axis)

    @property
    def replica_devices(self) -> int:
        """F: the devices of a replica, each syncing a share of its pseudo-gradient."""
        return int(np.prod([self.mesh.shape[a] for a in self.inner_axes]))

    def replica_mesh(self) -> Any:
        """The mesh as a replica's step sees it: the periodic axis manual (an AbstractMesh)."""
        return self.mesh.abstract_mesh.update_axis_types({self.axis: AxisType.Manual})

    def at_rest(self, shardings: Any) -> Any:
        """Per-replica `shardings` (NamedShardings within a replica) with the leading
        dimension over the periodic axis."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, P(self.axis, *s.spec)), shardings)

    def stack(self, tree: Any, shardings: Any) -> Any:
        """`tree` (one replica's arrays) copied to every replica: a leading dimension of S."""
        s = self.replicas
        return jax.jit(
            lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (s, *x.shape)), t),
            out_shardings=self.at_rest(shardings),
        )(tree)

    # ------------------------------------------------------------------ fragments, state

    def groups(self, params: Any) -> tuple[tuple[int, ...], ...]:
        """The parameter leaves (flatten order) of each fragment."""
        from xshard.reduce.periodic import fragment_leaves

        sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
        return fragment_leaves(sizes, self.rule.fragments)

    def init_outer(
        self,
        params: Any,
        shardings: Any,
        base: Any,
        opt_shardings: Callable,
        replica_shardings: Any = None,
    ) -> OuterState:
        """The outer state for one replica's `params`.

        Args:
          params: one replica's params.
          shardings: where the outer params live (within a replica, ZeRO-aware).
          base: the params' model-axis shardings.
          opt_shardings: ``(tx, leaves, base) -> shardings`` of an optimizer's state
            (`trainers.core.zero.ZeroLayout.opt_state_shardings`).
          replica_shardings: where a replica's params live (within a replica): the
            pseudo-gradients sent with a ``sync_delay`` live there, over the axis too.
        """
        groups = self.groups(params)
        leaves = jax.tree.leaves(params)
        frag = lambda xs: tuple([xs[i] for i in g] for g in groups)
        outer_tx = self.rule.outer_optimizer
        out_shardings = OuterState(
            frag(jax.tree.leaves(shardings)),
            tuple(
                opt_shardings(outer_tx, p, b)
                for p, b in zip(frag(leaves), frag(jax.tree.leaves(base)), strict=True)
            ),
            tuple(  # a row per device of each replica: its share's
                NamedSharding(self.mesh, residual_spec(self.axis, self.inner_axes))
                if self.rule.error_feedback
                else None
                for _ in groups
            ),
            None
            if not self.rule.sync_delay
            else frag(jax.tree.leaves(self.at_rest(replica_shardings))),
        )
        return jax.jit(
            lambda p: init_outer(self.rule, p, groups, self.replicas, self.replica_devices),
            out_shardings=out_shardings,
        )(leaves)

    def bytes_per_step(self, params: Any) -> float:
        """Bytes one device sends over the axis per step, averaged over a period: its share
        of every fragment's pseudo-gradient once per ``every_steps`` steps."""
        leaves = jax.tree.leaves(params)
        sent = sum(
            bytes_per_sync([leaves[i] for i in g], self.replicas, self.replica_devices, self.rule)
            for g in self.groups(params)
        )
        return sent / self.rule.every_steps

    # ------------------------------------------------------------------ programs

    def inner(
        self, run: Callable, state: TrainState, batch: Any, hyperparams: Any, vote: Any
    ) -> Any:
        """The inner program: ``run(state, batch, hyperparams, vote) -> (state, values)`` (the
        synchronous step of one replica, with its metrics vector) on every replica, inside a
        shard_map manual over the axis. Returns the new state and the metrics, a row per
        replica.

        The `hyperparams` (the same on every replica) enter the replica's step as varying over
        the axis (``jax.lax.pcast``, no collective): in a population (`jax.vmap` over trials)
        the non-finite guard's ``lax.cond`` becomes a select of both branches, whose operands
        come out varying; a branch tracing its own cast of them would then fail."""
        axis, rep = self.axis, P(self.axis)

        def one(params, opt_state, model_state, batch, step, hyperparams, vote):
            sub = TrainState(step, _squeeze(params), _squeeze(opt_state), model_state)
            new, values = run(sub, batch, jax.lax.pcast(hyperparams, axis, to="varying"), vote)
            return _expand(new.params), _expand(new.opt_state), new.step, values[None]

        params, opt_state, step, values = jax.shard_map(
            one,
            mesh=self.mesh,
            in_specs=(rep, rep, P(), rep, P(), P(), P()),
            out_specs=(rep, rep, P(), rep),
            axis_names={axis},
        )(state.params, state.opt_state, state.model_state, batch, state.step, hyperparams, vote)
        return state._replace(step=step, params=params, opt_state=opt_state), values

    def send(self, state: TrainState, fragment: int, groups: tuple[tuple[int, ...], ...]) -> Any:
        """The send program of `fragment` (with a ``sync_delay``): each replica's
        pseudo-gradient written into ``state.outer.pending``; nothing crosses the axis."""
        leaves = jax.tree.leaves(state.params)
        outer = state.outer
        sent = send_fragment(outer.params[fragment], [leaves[i] for i in groups[fragment]])
        return state._replace(
            outer=outer._replace(pending=_replace_at(outer.pending, fragment, sent))
        )

    def sync(self, state: TrainState, fragment: int, groups: tuple[tuple[int, ...], ...]) -> Any:
        """The sync program of `fragment`: returns the new state and the `SyncStats` vector.
        With a ``sync_delay`` it reduces what the replicas sent (``state.outer.pending``)."""
        axis, rep, rule, inner_axes = self.axis, P(self.axis), self.rule, self.inner_axes
        leaves, treedef = jax.tree.flatten(state.params)
        idx = groups[fragment]
        outer = state.outer
        residual = outer.residual[fragment]
        sent = None if outer.pending is None else outer.pending[fragment]

        def one(outer_params, opt_state, residual, replica, sent):
            res = None if residual is None else _squeeze(residual)
            done = sync_fragment(
                rule,
                axis,
                outer_params,
                opt_state,
                res,
                _squeeze(replica),
                inner_axes,
                None if sent is None else _squeeze(sent),
            )
            back = None if done.residual is None else _expand(done.residual)
            return done.params, done.opt_state, back, _expand(done.replica), done.stats

        params, opt_state, residual, replica, stats = jax.shard_map(
            one,
            mesh=self.mesh,
            in_specs=(P(), P(), rep, rep, rep),
            out_specs=(P(), P(), rep, rep, P()),
            axis_names={axis},
        )(
            outer.params[fragment],
            outer.opt_state[fragment],
            residual,
            [leaves[i] for i in idx],
            sent,
        )
        for i, x in zip(idx, replica, strict=True):
            leaves[i] = x
        new_outer = outer._replace(
            params=_replace_at(outer.params, fragment, params),
            opt_state=_replace_at(outer.opt_state, fragment, opt_state),
            residual=_replace_at(outer.residual, fragment, residual),
        )
        new_state = state._replace(
            params=treedef.unflatten(leaves),  # type: ignore[attr-defined]  # jaxlib: no stubs
            outer=new_outer,
        )
        return new_state, jnp.stack([jnp.asarray(v, jnp.float32) for v in stats])

    def sync_keys(self, fragment: int) -> tuple[str, ...]:
        """The metric names of `fragment`'s sync program's vector, in order (`SYNC_TAG`): one
        series per fragment, not fragments interleaved in one."""
        several = self.rule.fragments > 1
        series = f"{self.axis}/fragment_{fragment}" if several else self.axis
        return tuple(SYNC_TAG.format(series=series, name=name) for name in SyncStats._fields)


def _replace_at(items: tuple, i: int, value: Any) -> tuple:
    return (*items[:i], value, *items[i + 1 :])


def outer_params(state: TrainState) -> Any:
    """The params to evaluate, load and export (the one place they are taken from a state):
    the outer params of a periodic run (the last synced), else the params; for a
    schedule-free optimizer its evaluation params (`xshard.optim.schedule_free.eval_params`)."""
    if state.outer is None:
        return eval_params(state.opt_state, state.params)
    leaves, treedef = jax.tree.flatten(_squeeze_struct(state.params))
    flat: list[Any] = [None] * len(leaves)
    order = [i for frag in _groups_of(state.outer) for i in frag]
    values = [x for frag in state.outer.params for x in frag]
    for i, x in zip(order, values, strict=True):
        flat[i] = x
    return treedef.unflatten(flat)  # type: ignore[attr-defined]  # jaxlib: no stubs


def _squeeze_struct(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def _groups_of(outer: OuterState) -> list[range]:
    """The leaf indices of each fragment: contiguous, in order (`xshard.reduce.periodic`)."""
    out, start = [], 0
    for frag in outer.params:
        out.append(range(start, start + len(frag)))
        start += len(frag)
    return out
