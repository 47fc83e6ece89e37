"""The generic pjit trainer for xshard and its built-in tasks.

`run(cfg)` is the entry point for your own ``@hydra.main``: it trains like
``python -m trainers.train`` and keeps its exit statuses and one-line errors
(`trainers.entry.run`; imported on first use).
"""

from typing import TYPE_CHECKING, Any

from trainers.metrics import StepMetrics
from trainers.step import TrainState
from trainers.trainer import Hook, StopTraining, Trainer

__all__ = ["Hook", "StepMetrics", "StopTraining", "TrainState", "Trainer", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":  # lazily: importing `trainers` stays light
        from trainers.entry import run

        return run
    raise AttributeError(f"module 'trainers' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainers.entry import run as run
