"""An elastic periodic axis: its replicas are replica groups, each its own process and run.

In a group the axis has size 1 (its own mesh); the other groups are reached through an
`Exchange` (torchft's, `trainers.cluster.torchft_group`), on the host. A sync of an elastic axis is
two compiled programs around that exchange, reusing the periodic sync
(`trainers.core.periodic.axis.Periodic.sync`):

1. the *delta* program: this group's pseudo-gradient (outer params minus its params), raveled
   into one float32 vector, read to the host;
2. the exchange: the mean of the vectors over the groups in the quorum, weighted by what each
   sent (`Round`); a group (re)joining receives a live peer's `GroupState` in the same round;
3. the *apply* program: the periodic sync of the axis (of size 1) with that mean as what the
   replica sent (``OuterState.pending``): the outer optax step (skipped alike everywhere on a
   non-finite mean) and the replica restarting from the new outer params. Every group runs it
   on the same mean from the same outer state, so the outer params stay bitwise equal.

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

from trainers.core.periodic.axis import Periodic
from trainers.core.step.types import TrainState
from trainers.exits import GroupLost
from xshard.errors import ConfigError
from xshard.reduce.periodic import SyncStats

log = logging.getLogger(__name__)


class GroupState(NamedTuple):
    """What a live group hands a (re)joining one, as host arrays: the step (the data position
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

    def round(self, delta: np.ndarray, weight: float, snapshot: Callable[[], GroupState]) -> Round:
        """Sends `delta` with `weight` (0: nothing to average, e.g. joining) and returns the
        committed `Round`; `snapshot()` is this group's state, for a peer that needs it."""
        ...


def _flat(leaves: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _unflat(flat: jax.Array, like: list[Any]) -> list[jax.Array]:
    out, start = [], 0
    for x in like:
        size = int(np.prod(x.shape))
        out.append(flat[start : start + size].reshape(x.shape).astype(x.dtype))
        start += size
    return out


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
        self._delta: Any = None
        self._apply: Any = None

    def snapshot(self, state: TrainState) -> GroupState:
        """`state` as a peer receives it (host arrays)."""
        outer = state.outer
        host = jax.device_get((state.step, outer.params, outer.opt_state, state.opt_state))
        return GroupState(int(host[0]), *host[1:])

    def load(self, state: TrainState, peer: GroupState, shardings: Any) -> TrainState:
        """`state` with a peer's: its step, outer state and inner optimizer state, the
        replica's params restarted from the outer params.

        Raises:
          ConfigError: if the peer's state is not shaped as this group's (another config).
        """
        mine = (state.outer.params, state.outer.opt_state, state.opt_state)
        theirs = (peer.outer_params, peer.outer_opt_state, peer.opt_state)
        shapes = lambda t: jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype).name), t)
        if shapes(mine) != shapes(theirs):
            raise ConfigError(
                f"reduction.axes.{self.periodic.axis}.elastic: a peer's state differs from this "
                "group's in structure, shapes or dtypes; every group must run the same config "
                "(task, optimizer, reduction) but its group id."
            )
        target = shardings(state)
        outer = state.outer._replace(
            params=jax.device_put(peer.outer_params, target.outer.params),
            opt_state=jax.device_put(peer.outer_opt_state, target.outer.opt_state),
        )
        treedef = jax.tree.structure(state.params)
        restarted = [x[None] for frag in peer.outer_params for x in frag]
        params = jax.device_put(treedef.unflatten(restarted), target.params)  # type: ignore[attr-defined]
        return state._replace(
            step=jax.device_put(np.asarray(peer.step, np.int32), target.step),
            params=params,
            opt_state=jax.device_put(peer.opt_state, target.opt_state),
            outer=outer,
        )

    def sync(
        self, state: TrainState, hyperparams: Any, shardings: Any, apply: Callable, join: bool
    ) -> tuple[TrainState, Any]:
        """One sync (or, with `join`, the first round of a (re)starting group, which sends
        nothing and takes a peer's state and step if it is behind). `apply(state, mean)` is the
        compiled apply program. Returns the state and the sync's statistics (None: no sync
        applied).

        Raises:
          GroupLost: a peer's state arrived at another step outside a join.
        """
        step = int(jax.device_get(state.step))
        delta = np.asarray(jax.device_get(self.delta(state, shardings)), np.float32)
        what = "Join" if join else "Sync"
        log.info("%s at step %d: exchanging with the other groups.", what, step)
        start = time.monotonic()
        done = self.exchange.round(
            np.zeros_like(delta) if join else delta,
            0.0 if join else 1.0,
            lambda: self.snapshot(state),
        )
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
            state = self.load(state, done.healed, shardings)
        if done.mean is None:
            return state, None
        state, stats = apply(state, hyperparams, jnp.asarray(done.mean))
        drift = SyncStats._fields.index("replica_drift")  # this group's own, not the mean's
        return state, stats.at[drift].set(float(np.linalg.norm(delta)))

    def delta(self, state: TrainState, shardings: Any) -> jax.Array:
        """This group's pseudo-gradient, raveled (the delta program, compiled once)."""
        if self._delta is None:
            self._delta = jax.jit(
                lambda s: _flat(
                    [
                        o - r[0]
                        for o, r in zip(s.outer.params[0], jax.tree.leaves(s.params), strict=True)
                    ]
                ),
                in_shardings=(shardings(state),),
            )
        return self._delta(state)

    def apply_fn(self, groups: tuple[tuple[int, ...], ...]) -> Callable:
        """The apply program's function ``(state, periodic, mean) -> (state, statistics)``:
        the periodic sync with `mean` as what the replica sent."""

        def apply(state: TrainState, periodic: Periodic, mean: jax.Array) -> Any:
            sent = [x[None] for x in _unflat(mean, state.outer.params[0])]
            with_sent = state._replace(outer=state.outer._replace(pending=(sent,)))
            new, stats = periodic.sync(with_sent, 0, groups)
            return new._replace(outer=new.outer._replace(pending=None)), stats

        return apply
