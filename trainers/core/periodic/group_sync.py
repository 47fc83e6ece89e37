"""An elastic periodic axis: its replicas are replica groups, each its own run (one process,
or a ``jax.distributed`` job of several).

In a group the axis has size 1 (its own mesh); the other groups are reached through an
`Exchange` (torchft's, `trainers.cluster.torchft_group`), on the host. A sync of an elastic axis is
two compiled programs around that exchange, reusing the periodic sync
(`trainers.core.periodic.axis.Periodic.sync`):

1. the *delta* program: this group's pseudo-gradient (outer params minus its params), raveled
   into one float32 vector split over the mesh's devices; each process reads its piece to the
   host (`trainers.core.periodic.local_arrays`);
2. the exchange, in each process on its piece (torchft pairs rank r of every group): the mean
   of the vectors over the groups in the quorum, weighted by what each sent (`Round`), rebuilt
   into a vector split as the delta was; a group (re)joining receives, in each process, what
   the same rank of a live peer holds of its state (`GroupState`) in the same round;
3. the *apply* program: the periodic sync of the axis (of size 1) with that mean as what the
   replica sent (``OuterState.pending``): the outer optax step (skipped alike everywhere on a
   non-finite mean) and the replica restarting from the new outer params. Every group runs it
   on the same mean from the same outer state, so the outer params stay bitwise equal.

A group that took a peer's state restarts its replica from the peer's outer params with a
third, the *heal* program. The three (`ElasticPrograms`) are compiled before the group meets
its peers (`trainers.core.periodic.sync.PeriodicPrograms.compile_elastic`): a warm standby
before its go, a starting group before its join round; compiled in the round, the peers
would wait for them.

Nothing here imports torch: the exchange is a protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.core.periodic.axis import Periodic
from trainers.core.periodic.local_arrays import (
    from_local_parts,
    global_vector,
    layout,
    local_parts,
    local_vector,
    padded_size,
    vector_sharding,
)
from trainers.core.step.types import TrainState
from trainers.exits import GroupLost
from xshard.errors import ConfigError
from xshard.reduce.periodic import SyncStats

log = logging.getLogger(__name__)


class GroupState(NamedTuple):
    """What a live group's process hands the same rank of a (re)joining group, as
    `trainers.core.periodic.local_arrays.LocalParts` (what it holds): the step (the data position
    too: a group's data is a function of its step), the outer params and the outer optimizer's
    state (`xshard.reduce.periodic.OuterState` fields), and its inner optimizer's state."""

    step: int
    outer_params: Any
    outer_opt_state: Any
    opt_state: Any


class Round(NamedTuple):
    """One committed exchange: the mean pseudo-gradient over the quorum (None: no group sent
    any, as when every group is joining), the peer state this group loaded in the round
    (None: it needed none) and the weight the mean is over (the groups that sent a delta)."""

    mean: np.ndarray | None
    healed: GroupState | None
    groups: float


class Exchange(Protocol):
    """Averages a vector over the replica groups (torchft's:
    `trainers.cluster.torchft_group.TorchftExchange`)."""

    def round(
        self, delta: np.ndarray, weight: float, snapshot: Callable[[], GroupState]
    ) -> Round | None:
        """Sends `delta` with `weight` (0: nothing to average, e.g. joining) and returns the
        committed `Round`; `snapshot()` is this group's state, for a peer that needs it.
        None: the round was left on a stop request (this group commits nothing in it)."""
        ...


class ElasticPrograms(NamedTuple):
    """An elastic axis's compiled programs around the exchange (module docstring), for one
    state's shapes: `delta` (``state -> (delta vector, its norm)``: `delta_program`), `apply`
    (``(state, hyperparameters, mean) -> (state, statistics)``: `apply_fn`, compiled by
    `trainers.core.periodic.sync.PeriodicPrograms`) and `heal` (a peer's outer params -> the
    replica's params: `heal_program`)."""

    delta: jax.stages.Compiled
    apply: jax.stages.Compiled
    heal: jax.stages.Compiled


def _flat(leaves: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _unflat(flat: jax.Array, like: list[Any]) -> list[jax.Array]:
    out, start = [], 0
    for x in like:
        size = int(np.prod(x.shape))
        out.append(flat[start : start + size].reshape(x.shape).astype(x.dtype))
        start += size
    return out


def _log_left(step: int, seconds: float, join: bool) -> None:
    """Says, in one line, that a round was left on a stop request and what the group stops
    with."""
    then = (
        "before its first step"
        if join
        else f"with step {step}'s state before this sync, a committed one (its checkpoint)"
    )
    log.warning(
        "%s at step %d left on a stop request after %.2f s: this group committed nothing in it "
        "(its peers retry without it); it stops %s.",
        "Join" if join else "Sync",
        step,
        seconds,
        then,
    )


class ElasticSync:
    """The sync of an elastic axis (module docstring): its two programs and the exchange.

    Args:
      periodic: the axis (of size 1 in this group's mesh; one fragment).
      exchange: the exchange with the other groups.
    """

    def __init__(self, periodic: Periodic, exchange: Exchange):
        if periodic.replicas != 1:
            raise ConfigError(
                f"reduction.axes.{periodic.axis}.elastic: the groups are the replicas of "
                f"{periodic.axis!r}, which must have size 1 in a group's mesh (got "
                f"{periodic.replicas}); use a mesh such as mesh=cpu4_group."
            )
        self.periodic, self.exchange = periodic, exchange

    def snapshot(self, state: TrainState) -> GroupState:
        """What this process holds of `state`, as a peer of the same rank receives it
        (`trainers.core.periodic.local_arrays.LocalParts`)."""
        outer = state.outer
        step = int(jax.device_get(state.step))
        return GroupState(step, *local_parts((outer.params, outer.opt_state, state.opt_state)))

    def load(
        self, state: TrainState, peer: GroupState, shardings: Any, heal: jax.stages.Compiled
    ) -> TrainState:
        """`state` with a peer's: its step, outer state and inner optimizer state, the
        replica's params restarted from the outer params (the compiled `heal_program`).

        Raises:
          ConfigError: if the peer's state is not shaped as this group's (another config).
        """
        mine = (state.outer.params, state.outer.opt_state, state.opt_state)
        theirs = (peer.outer_params, peer.outer_opt_state, peer.opt_state)
        if layout(mine) != layout(theirs):
            raise ConfigError(
                f"reduction.axes.{self.periodic.axis}.elastic: a peer's state differs from this "
                "group's in structure, shapes, dtypes or layout; every group must run the same "
                "config (task, optimizer, reduction, mesh) but its group id."
            )
        target = shardings(state)
        outer_params, outer_opt, opt = from_local_parts(
            theirs, (target.outer.params, target.outer.opt_state, target.opt_state)
        )
        outer = state.outer._replace(params=outer_params, opt_state=outer_opt)
        step = jax.make_array_from_callback((), target.step, lambda _: np.int32(peer.step))
        return state._replace(step=step, params=heal(outer_params), opt_state=opt, outer=outer)

    def sync(
        self,
        state: TrainState,
        hyperparams: Any,
        shardings: Any,
        programs: ElasticPrograms,
        join: bool,
    ) -> tuple[TrainState, Any]:
        """One sync (or, with `join`, the first round of a (re)starting group, which sends
        nothing and takes a peer's state and step if it is behind), with the compiled
        `programs` (nothing compiles here). Each process sends its piece of the delta vector
        (`local_arrays.local_vector`) and rebuilds the mean from its piece of it. Returns the
        state and the sync's statistics (None: no sync applied, as when a stop request left
        the round: `state` as it was).

        Raises:
          GroupLost: a peer's state arrived at another step outside a join.
        """
        step = int(jax.device_get(state.step))
        vector, norm = programs.delta(state)
        delta = local_vector(vector)
        what = "Join" if join else "Sync"
        log.info("%s at step %d: exchanging with the other groups.", what, step)
        start = time.monotonic()
        done = self.exchange.round(
            np.zeros_like(delta) if join else delta,
            0.0 if join else 1.0,
            lambda: self.snapshot(state),
        )
        if done is None:  # the run's stop request, seen by the loop after this sync
            _log_left(step, time.monotonic() - start, join)
            return state, None
        log.info(
            "%s at step %d committed in %.2f s, the mean over %g groups.",
            what,
            step,
            time.monotonic() - start,
            done.groups,
        )
        if done.healed is not None:
            if not join and done.healed.step != step:
                raise GroupLost(
                    f"this group is at step {step} and its peers at {done.healed.step}: it "
                    "failed to commit a sync they committed; restart it to rejoin from a live peer."
                )
            state = self.load(state, done.healed, shardings, programs.heal)
        if done.mean is None:
            return state, None
        mean = global_vector(done.mean.astype(np.float32), self.periodic.mesh, vector.shape[0])
        state, stats = programs.apply(state, hyperparams, mean)
        drift = SyncStats._fields.index("replica_drift")  # this group's own, not the mean's
        return state, stats.at[drift].set(float(jax.device_get(norm)))


def delta_vector(mesh: Mesh, state: TrainState) -> jax.ShapeDtypeStruct:
    """The delta vector's shape and placement: the outer params' size, padded to a multiple
    of the `mesh`'s devices, split over them (`local_arrays.vector_sharding`)."""
    size = sum(int(np.prod(x.shape)) for x in state.outer.params[0])
    return jax.ShapeDtypeStruct(
        (padded_size(size, mesh),), np.float32, sharding=vector_sharding(mesh)
    )


def delta_program(mesh: Mesh, state: TrainState, target: Any) -> jax.stages.Compiled:
    """The delta program for states like `state` placed as `target` (their shardings): this
    group's pseudo-gradient (outer params minus its params), raveled and padded
    (`delta_vector`), and its norm."""
    like = delta_vector(mesh, state)

    def delta(s: TrainState) -> tuple[jax.Array, jax.Array]:
        leaves = jax.tree.leaves(s.params)
        flat = _flat([o - r[0] for o, r in zip(s.outer.params[0], leaves, strict=True)])
        padded = jnp.pad(flat, (0, like.shape[0] - flat.shape[0]))
        return padded, jnp.linalg.norm(flat)

    replicated = NamedSharding(mesh, P())
    jitted = jax.jit(delta, in_shardings=(target,), out_shardings=(like.sharding, replicated))
    return jitted.lower(state).compile()


def heal_program(state: TrainState, target: Any) -> jax.stages.Compiled:
    """The heal program for states like `state` placed as `target`: outer params (a peer's)
    -> the replica's params restarted from them (the axis's leading dimension of 1)."""
    treedef = jax.tree.structure(state.params)

    def heal(outer_params: Any) -> Any:
        return treedef.unflatten(  # type: ignore[attr-defined]
            [x[None] for frag in outer_params for x in frag]
        )

    jitted = jax.jit(heal, in_shardings=(target.outer.params,), out_shardings=target.params)
    return jitted.lower(state.outer.params).compile()


def apply_fn(groups: tuple[tuple[int, ...], ...]) -> Callable:
    """The apply program's function ``(state, periodic, mean) -> (state, statistics)``: the
    periodic sync with `mean` (padded: `delta_vector`) as what the replica sent; `groups`: the
    parameter leaves of each fragment (one)."""

    def apply(state: TrainState, periodic: Periodic, mean: jax.Array) -> Any:
        sent = [x[None] for x in _unflat(mean, state.outer.params[0])]
        with_sent = state._replace(outer=state.outer._replace(pending=(sent,)))
        new, stats = periodic.sync(with_sent, 0, groups)
        return new._replace(outer=new.outer._replace(pending=None)), stats

    return apply
