"""The ``sharding`` config node: the ZeRO stage, how the run's state is spread over the
data-parallel axes (the model-axis rules of a task are `trainers.tasks.sharding`'s).

Keys, defaults and the one check of ``sharding.zero_stage`` live here (see docs/scaling.md);
the trainer's `trainers.core.zero` turns the stage into shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainers.config.run import check_int
from xshard.config.nodes import read_node

#: The allowed values of ``sharding.zero_stage``.
ZERO_STAGES = (0, 1, 2, 3)


def check_zero_stage(value: Any, key: str = "sharding.zero_stage") -> int:
    """Returns `value` if it is a ZeRO stage (0, 1, 2 or 3).

    Raises:
      ConfigError: naming `key`, the value and the allowed stages.
    """
    return check_int(
        value,
        key,
        ZERO_STAGES[0],
        "0 (replicated), 1 (optimizer state sharded over the data axes), 2 (and the gradient "
        "reduce-scattered) or 3 (and the params: FSDP)",
        ZERO_STAGES[-1],
    )


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """The ``sharding`` node.

    Attributes:
      zero_stage: 0 replicates params, gradients and optimizer state over the data axes
        (only the task's model-axis rules shard them); 1 shards the optimizer state over the
        data axes (ZeRO-1); 2 also reduce-scatters the gradient and updates each device's
        slice (ZeRO-2); 3 also keeps the params sharded between steps (ZeRO-3 / FSDP).
    """

    zero_stage: int = 0

    @classmethod
    def from_config(cls, node: Any) -> ShardingOptions:
        """Reads the ``sharding`` node (`read_node`: one-line errors naming the key); an absent
        node gives the defaults."""
        return read_node(cls, {} if node is None else node, "sharding")

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)
