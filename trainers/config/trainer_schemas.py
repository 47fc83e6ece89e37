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
from trainers.config.zero_options import ShardingOptions
from xshard.config.elastic_groups import ElasticConf
from xshard.config.nodes import location_keys, permissive
from xshard.config.schemas import register_schemas

#: The trainer's top-level config nodes and their schemas.
NODES: dict[str, type] = {
    "trainer": TrainerOptions,
    "distributed": DistributedOptions,
    "checkpoint": CheckpointOptions,
    "logger": LoggerOptions,
    "paths": PathsOptions,
    "sharding": ShardingOptions,
    "precision": PrecisionOptions,
}

#: ``{group: {name: schema}}`` of the trainer's nodes.
TRAINER_SCHEMAS: dict[str, dict[str, Any]] = {
    **{node: {"base": permissive(schema)} for node, schema in NODES.items()},
    # task.data of the built-in task options (``/xshard_schemas/data@data: base``).
    "data": {"base": permissive(DataOptions)},
    # Each option of the logger group: ``/xshard_schemas/logger/wandb@wandb`` in logger/wandb.yaml.
    "logger_node": {name: permissive(schema) for name, schema in LOGGERS.items()},
}

#: Every key marked `xshard.config.nodes.LOCATION` in the trainer's schemas: where a run writes
#: or connects (``paths.*``, ``logger.csv.path``, ``trainer.compilation_cache_dir``, ...; an
#: elastic axis's lighthouse and host, ``*`` standing for the axis).
LOCATION_KEYS: tuple[str, ...] = tuple(
    key for node, schema in NODES.items() for key in location_keys(schema, node)
) + location_keys(ElasticConf, "reduction.axes.*.elastic")  # the lighthouse, the host


def register_trainer_schemas(cs: ConfigStore | None = None) -> None:
    """Stores the trainer's schemas as ``xshard_schemas/<group>/base`` (idempotent)."""
    register_schemas(cs, TRAINER_SCHEMAS)
