"""xshard: config-driven cross-shard optimizers and meshes for JAX training.

The public names below are imported on first use, so ``import xshard`` (and the JAX-free
``xshard.config``) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ConfigError": "xshard.errors",
    "CrossShardPhases": "xshard.optim.cross_shard",
    "CrossShardSpec": "xshard.optim.cross_shard",
    "CrossShardState": "xshard.optim.cross_shard",
    "CrossShardTransformation": "xshard.optim.cross_shard",
    "DoubleReductionError": "xshard.mesh.context",
    "MeshConfigError": "xshard.mesh.build",
    "Reduction": "xshard.config.reduction",
    "build_mesh": "xshard.mesh.build",
    "build_optimizer": "xshard.optim.factory",
    "build_schedule": "xshard.optim.factory",
    "check_axis_names": "xshard.mesh.build",
    "check_batch_divisible": "xshard.mesh.build",
    "configure_devices": "xshard.mesh.build",
    "cross_shard": "xshard.optim.cross_shard",
    "data_axes": "xshard.mesh.build",
    "data_parallel_size": "xshard.mesh.build",
    "get_hyperparams": "xshard.optim.slots",
    "get_slot": "xshard.optim.slots",
    "get_slot_names": "xshard.optim.slots",
    "inner_state": "xshard.optim.slots",
    "reduce_gradients": "xshard.reduce.gradients",
    "tree_map_params": "xshard.optim.packed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'xshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # names for type checkers and IDEs; imported lazily above
    from xshard.config.reduction import Reduction as Reduction
    from xshard.errors import ConfigError as ConfigError
    from xshard.mesh.build import MeshConfigError as MeshConfigError
    from xshard.mesh.build import build_mesh as build_mesh
    from xshard.mesh.build import check_axis_names as check_axis_names
    from xshard.mesh.build import check_batch_divisible as check_batch_divisible
    from xshard.mesh.build import configure_devices as configure_devices
    from xshard.mesh.build import data_axes as data_axes
    from xshard.mesh.build import data_parallel_size as data_parallel_size
    from xshard.mesh.context import DoubleReductionError as DoubleReductionError
    from xshard.optim.cross_shard import CrossShardPhases as CrossShardPhases
    from xshard.optim.cross_shard import CrossShardSpec as CrossShardSpec
    from xshard.optim.cross_shard import CrossShardState as CrossShardState
    from xshard.optim.cross_shard import CrossShardTransformation as CrossShardTransformation
    from xshard.optim.cross_shard import cross_shard as cross_shard
    from xshard.optim.factory import build_optimizer as build_optimizer
    from xshard.optim.factory import build_schedule as build_schedule
    from xshard.optim.packed import tree_map_params as tree_map_params
    from xshard.optim.slots import get_hyperparams as get_hyperparams
    from xshard.optim.slots import get_slot as get_slot
    from xshard.optim.slots import get_slot_names as get_slot_names
    from xshard.optim.slots import inner_state as inner_state
    from xshard.reduce.gradients import reduce_gradients as reduce_gradients
