"""The generic pjit trainer for xshard and its built-in tasks.

`run(cfg)` is the entry point for your own Hydra main: it trains like ``python -m
trainers.train`` and keeps its exit statuses and one-line errors (`trainers.entry.run`).
Decorate that main with `main` (`trainers.app_main.main`) rather than ``@hydra.main``: it
checks every composed config file before Hydra acts on it and handles stop signals from the
start. Every name is imported on first use, so ``import trainers`` stays light and an entry
point can latch stop signals before JAX is imported (`trainers.signal_latch`).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "Hook": "trainers.trainer",
    "StepMetrics": "trainers.metrics",
    "StopTraining": "trainers.trainer",
    "TrainState": "trainers.step",
    "Trainer": "trainers.trainer",
    "main": "trainers.app_main",
    "run": "trainers.entry",
}
__all__ = ["Hook", "StepMetrics", "StopTraining", "TrainState", "Trainer", "main", "run"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainers' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainers.app_main import main as main
    from trainers.entry import run as run
    from trainers.metrics import StepMetrics as StepMetrics
    from trainers.step import TrainState as TrainState
    from trainers.trainer import Hook as Hook
    from trainers.trainer import StopTraining as StopTraining
    from trainers.trainer import Trainer as Trainer
