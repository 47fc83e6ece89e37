"""xshard: config-driven cross-shard optimizers and meshes for JAX training."""

from xshard.cross_shard import (
    CrossShardState,
    DoubleReductionError,
    Reduction,
    cross_shard,
    reduce_gradients,
)
from xshard.slots import get_hyperparams, get_slot, get_slot_names, inner_state

__all__ = [
    "CrossShardState",
    "DoubleReductionError",
    "Reduction",
    "cross_shard",
    "get_hyperparams",
    "get_slot",
    "get_slot_names",
    "inner_state",
    "reduce_gradients",
]
