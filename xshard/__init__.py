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
    "CrossShardState": "xshard.optimizer",
    "DoubleReductionError": "xshard.reduce",
    "MeshConfigError": "xshard.mesh",
    "Reduction": "xshard.reduce",
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


if TYPE_CHECKING:
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
    from xshard.optimizer import CrossShardState, cross_shard
    from xshard.reduce import DoubleReductionError, Reduction, reduce_gradients
    from xshard.slots import get_hyperparams, get_slot, get_slot_names, inner_state
