"""The generic pjit trainer for xshard and its built-in tasks.

`run(cfg)` is the entry point for your own Hydra main: it trains like ``python -m
trainers.train`` and keeps its exit statuses and one-line errors (`trainers.app.entry.run`).
Decorate that main with `main` (`trainers.app.main.main`) rather than ``@hydra.main``: it
checks every composed config file before Hydra acts on it and handles stop signals from the
start. `load(run_dir, step=None)` loads a saved checkpoint for inference and
`export_params(params, "params.npz")` writes its params for use without xshard
(`trainers.app.checkpoint_use`). Every name is imported on first use, so ``import trainers``
stays light and an entry point can latch stop signals before JAX is imported
(`trainers.cluster.signal_latch`).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_EXPORTS = {
    "Hook": "trainers.core.trainer",
    "StepMetrics": "trainers.core.metrics",
    "StopTraining": "trainers.core.trainer",
    "TrainState": "trainers.core.step.types",
    "Trainer": "trainers.core.trainer",
    "export_params": "trainers.app.checkpoint_use",
    "load": "trainers.app.checkpoint_use",
    "main": "trainers.app.main",
    "run": "trainers.app.entry",
}
__all__ = [
    "Hook",
    "StepMetrics",
    "StopTraining",
    "TrainState",
    "Trainer",
    "export_params",
    "load",
    "main",
    "run",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainers' has no attribute {name!r}")


if TYPE_CHECKING:
    from trainers.app.checkpoint_use import export_params as export_params
    from trainers.app.checkpoint_use import load as load
    from trainers.app.entry import run as run
    from trainers.app.main import main as main
    from trainers.core.metrics import StepMetrics as StepMetrics
    from trainers.core.step.types import TrainState as TrainState
    from trainers.core.trainer import Hook as Hook
    from trainers.core.trainer import StopTraining as StopTraining
    from trainers.core.trainer import Trainer as Trainer
