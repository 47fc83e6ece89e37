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
    "CrossShardPhases": "xshard.optimizer",
    "CrossShardSpec": "xshard.optimizer",
    "CrossShardState": "xshard.optimizer",
    "CrossShardTransformation": "xshard.optimizer",
    "DoubleReductionError": "xshard.shard_context",
    "MeshConfigError": "xshard.mesh",
    "Reduction": "xshard.reduction_mode",
    "build_mesh": "xshard.mesh",
    "build_optimizer": "xshard.factory",
    "build_schedule": "xshard.factory",
    "check_axis_names": "xshard.mesh",
    "check_batch_divisible": "xshard.mesh",
    "configure_devices": "xshard.mesh",
    "cross_shard": "xshard.optimizer",
    "data_axes": "xshard.mesh",
    "data_parallel_size": "xshard.mesh",
    "get_hyperparams": "xshard.slots",
    "get_slot": "xshard.slots",
    "get_slot_names": "xshard.slots",
    "inner_state": "xshard.slots",
    "reduce_gradients": "xshard.reduce",
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
    from xshard.errors import ConfigError as ConfigError
    from xshard.factory import build_optimizer as build_optimizer
    from xshard.factory import build_schedule as build_schedule
    from xshard.mesh import MeshConfigError as MeshConfigError
    from xshard.mesh import build_mesh as build_mesh
    from xshard.mesh import check_axis_names as check_axis_names
    from xshard.mesh import check_batch_divisible as check_batch_divisible
    from xshard.mesh import configure_devices as configure_devices
    from xshard.mesh import data_axes as data_axes
    from xshard.mesh import data_parallel_size as data_parallel_size
    from xshard.optimizer import CrossShardPhases as CrossShardPhases
    from xshard.optimizer import CrossShardSpec as CrossShardSpec
    from xshard.optimizer import CrossShardState as CrossShardState
    from xshard.optimizer import CrossShardTransformation as CrossShardTransformation
    from xshard.optimizer import cross_shard as cross_shard
    from xshard.reduce import reduce_gradients as reduce_gradients
    from xshard.reduction_mode import Reduction as Reduction
    from xshard.shard_context import DoubleReductionError as DoubleReductionError
    from xshard.slots import get_hyperparams as get_hyperparams
    from xshard.slots import get_slot as get_slot
    from xshard.slots import get_slot_names as get_slot_names
    from xshard.slots import inner_state as inner_state
