"""Built-in example tasks (model + data, pure JAX) and the task contract the trainer relies on."""

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
