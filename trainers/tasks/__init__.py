"""Built-in example tasks (model + data, pure JAX) and the task contract the trainer relies on.

The `Task` protocol (`base`), the MLP teacher regression and the tiny GPT (`tiny_gpt`, its
block in `gpt_layers`, its data in `corpus_windows`), Flax NNX and linen adapters, and the
sharding rules of their params (`sharding`, `logical`).

May import: `trainers.data`, `trainers.config`, `trainers.errors`, `xshard`.
"""

from trainers.data.batch import Batch
from trainers.tasks.base import Params, Task
from trainers.tasks.mlp import MLPTask
from trainers.tasks.sharding import param_shardings, param_specs
from trainers.tasks.tiny_gpt import TinyGPTTask

__all__ = [
    "Batch",
    "MLPTask",
    "Params",
    "Task",
    "TinyGPTTask",
    "param_shardings",
    "param_specs",
]
