"""Built-in example tasks (model + data, pure JAX) and the task contract the trainer relies on.

The `Task` protocol (`base`), the MLP teacher regression and the tiny GPT (`tiny_gpt`, its
block in `gpt_layers`, its data in `corpus_windows`), Flax NNX and linen adapters, and the
sharding rules of their params (`sharding`, `logical`).

May import: `trainers.data`, `trainers.config`, `trainers.exits`, `xshard`.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it. Imported on first use, so that a wing which
#: needs one module (the trainer: `sharding`) does not import every task and its options.
_EXPORTS = {
    "Batch": "trainers.data.batch",
    "MLPTask": "trainers.tasks.mlp",
    "Params": "trainers.tasks.base",
    "Task": "trainers.tasks.base",
    "TinyGPTTask": "trainers.tasks.tiny_gpt",
    "param_shardings": "trainers.tasks.sharding",
    "param_specs": "trainers.tasks.sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainers.tasks' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainers.data.batch import Batch as Batch
    from trainers.tasks.base import Params as Params
    from trainers.tasks.base import Task as Task
    from trainers.tasks.mlp import MLPTask as MLPTask
    from trainers.tasks.sharding import param_shardings as param_shardings
    from trainers.tasks.sharding import param_specs as param_specs
    from trainers.tasks.tiny_gpt import TinyGPTTask as TinyGPTTask
