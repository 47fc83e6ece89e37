"""Typed readers of the composed config: one place for the checks of each config node.

Each node the trainer reads (``trainer``, ``distributed``, the run's ``seed``) has a dataclass
here whose field types and ``__post_init__`` say what is allowed. `read_node` turns the composed
node into that dataclass and reports anything wrong as one `ConfigError` that names the key,
the value and what is allowed. `xshard.config.schemas` registers the schemas with Hydra.
"""

from xshard.config.nodes import one_line, read_node, shown
from xshard.config.outputs import CheckpointOptions, LoggerOptions, PathsOptions
from xshard.config.run import DistributedOptions, TrainerOptions, check_seed
from xshard.config.sharding import ShardingOptions

__all__ = [
    "CheckpointOptions",
    "DistributedOptions",
    "LoggerOptions",
    "PathsOptions",
    "ShardingOptions",
    "TrainerOptions",
    "check_seed",
    "one_line",
    "read_node",
    "shown",
]
