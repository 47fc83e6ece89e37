"""The trainer's option nodes as structured-config schemas, registered beside the library's.

Each composed node is checked after composition by `xshard.config.read_node` (one-line errors
naming the key), so Hydra gets permissive copies (`xshard.config.nodes.permissive`): they give
the YAML options their keys and defaults without Hydra's own type errors. Registered by the
``xshard_searchpath`` plugin under ``xshard_schemas/<group>/base``. Imports no JAX.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

from trainers.config.data import DataOptions
from trainers.config.loggers import LOGGERS
from trainers.config.outputs import CheckpointOptions, LoggerOptions, PathsOptions
from trainers.config.precision import PrecisionOptions
from trainers.config.run import DistributedOptions, TrainerOptions
from trainers.config.sharding import ShardingOptions
from xshard.config.nodes import permissive
from xshard.config.schemas import register_schemas

#: ``{group: {name: schema}}`` of the trainer's nodes.
TRAINER_SCHEMAS: dict[str, dict[str, Any]] = {
    "trainer": {"base": permissive(TrainerOptions)},
    "distributed": {"base": permissive(DistributedOptions)},
    "checkpoint": {"base": permissive(CheckpointOptions)},
    "logger": {"base": permissive(LoggerOptions)},
    "paths": {"base": permissive(PathsOptions)},
    "sharding": {"base": permissive(ShardingOptions)},
    "precision": {"base": permissive(PrecisionOptions)},
    # task.data of the built-in task options (``/xshard_schemas/data@data: base``).
    "data": {"base": permissive(DataOptions)},
    # Each option of the logger group: ``/xshard_schemas/logger/wandb@wandb`` in logger/wandb.yaml.
    "logger_node": {name: permissive(schema) for name, schema in LOGGERS.items()},
}


def register_trainer_schemas(cs: ConfigStore | None = None) -> None:
    """Stores the trainer's schemas as ``xshard_schemas/<group>/base`` (idempotent)."""
    register_schemas(cs, TRAINER_SCHEMAS)
