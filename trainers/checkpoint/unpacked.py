"""Checkpoints saved before `xshard.cross_shard`'s state packed its statistics and the guard's
counters (`xshard.optim.cross_shard_types.CrossShardState.stats`, issue 38): restored in the
layout they were saved in, then packed, so that a run resumes from them as from its own.

`saved_unpacked` tells such a checkpoint by its signature, `unpacked_abstract` is the state it
holds (what Orbax restores into), `packed_like` converts the restored state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from xshard.optim.cross_shard import CrossShardState

#: A leaf path that only a checkpoint of the unpacked layout holds (the guard's counter).
UNPACKED_MARK = ".guard.total_notfinite"


class UnpackedCrossShardState(NamedTuple):
    """A `CrossShardState` as checkpoints held it before the packing: its field names are the
    saved leaf paths (``opt_state.reduced.norm``, ``opt_state.guard.inner_state...``)."""

    clip: Any
    shards: Any
    reduced: Any
    histograms: Any
    guard: Any  # `xshard.guard.state.SkipIfNonFiniteState`: the counters and the inner state
    comm: Any


def saved_unpacked(signature: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's state signature (`trainers.checkpoint.save.state_signature`) is
    of the unpacked layout."""
    return any(path.endswith(UNPACKED_MARK) for path in signature)


def _each_cross_shard_state(fn: Any, tree: Any, kind: type = CrossShardState) -> Any:
    """`tree` with `fn` applied to each of its states of type `kind`."""
    return jax.tree.map(
        lambda x: fn(x) if isinstance(x, kind) else x, tree, is_leaf=lambda x: isinstance(x, kind)
    )


def unpacked_abstract(abstract: Any) -> Any:
    """`abstract` (`jax.ShapeDtypeStruct`s with shardings) with each `CrossShardState` in the
    unpacked layout: the statistics and counters take their packed vectors' sharding."""

    def unpack(state: CrossShardState) -> UnpackedCrossShardState:
        sharding = state.stats.vectors[0].sharding
        recorded = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(lambda stats: stats.unpack(), state.stats),
        )
        guard = recorded.counters._replace(inner_state=state.inner_state)
        return UnpackedCrossShardState(
            recorded.clip, recorded.shards, recorded.reduced, recorded.histograms, guard, state.comm
        )

    return _each_cross_shard_state(unpack, abstract)


def packed_like(state: Any, like: Any) -> Any:
    """A restored state of the unpacked layout (`unpacked_abstract`'s), packed as `like` is
    (its shardings)."""

    def pack(old: UnpackedCrossShardState) -> CrossShardState:
        return CrossShardState.of(
            old.clip, old.shards, old.reduced, old.histograms, old.guard, old.comm
        )

    def convert(tree: Any) -> Any:
        return _each_cross_shard_state(pack, tree, UnpackedCrossShardState)

    return jax.jit(convert, out_shardings=jax.tree.map(lambda x: x.sharding, like))(state)
