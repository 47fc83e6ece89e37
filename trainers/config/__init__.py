"""The trainer's own option nodes, JAX-free: ``trainer``, ``distributed``, ``paths``,
``checkpoint``, ``logger``, ``sharding``, ``precision`` and a task's ``data``.

Each node has a dataclass here whose field types and ``__post_init__`` say what is allowed
(`xshard.config.read_node` reads a composed node into it with one-line errors), and a
permissive copy registered with Hydra (`trainers.config.trainer_schemas`) so that YAML options
extend it. May import: `xshard.config`, `xshard.errors`, `trainers.exits`; nothing that imports JAX.
"""

from trainers.config.data import DataOptions
from trainers.config.outputs import CheckpointOptions, LoggerOptions, PathsOptions
from trainers.config.precision import PrecisionOptions
from trainers.config.run import DistributedOptions, TrainerOptions, check_seed
from trainers.config.zero_options import ShardingOptions

__all__ = [
    "CheckpointOptions",
    "DataOptions",
    "DistributedOptions",
    "LoggerOptions",
    "PathsOptions",
    "PrecisionOptions",
    "ShardingOptions",
    "TrainerOptions",
    "check_seed",
]
