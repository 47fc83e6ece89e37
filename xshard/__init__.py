"""xshard: config-driven cross-shard optimizers and meshes for JAX training."""

from xshard.cross_shard import (
    CrossShardState,
    DoubleReductionError,
    Reduction,
    cross_shard,
    reduce_gradients,
)
from xshard.errors import ConfigError
from xshard.factory import build_optimizer, build_schedule
from xshard.mesh import (
    MeshConfigError,
    build_mesh,
    check_axis_names,
    check_batch_divisible,
    configure_devices,
    data_axes,
    data_parallel_size,
)
from xshard.slots import get_hyperparams, get_slot, get_slot_names, inner_state

__all__ = [
    "ConfigError",
    "CrossShardState",
    "DoubleReductionError",
    "MeshConfigError",
    "Reduction",
    "build_mesh",
    "build_optimizer",
    "build_schedule",
    "check_axis_names",
    "check_batch_divisible",
    "configure_devices",
    "cross_shard",
    "data_axes",
    "data_parallel_size",
    "get_hyperparams",
    "get_slot",
    "get_slot_names",
    "inner_state",
    "reduce_gradients",
]
