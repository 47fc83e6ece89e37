"""The generic pjit trainer for xshard and its built-in tasks."""

from trainers.metrics import StepMetrics
from trainers.step import TrainState
from trainers.trainer import Hook, StopTraining, Trainer

__all__ = ["Hook", "StepMetrics", "StopTraining", "TrainState", "Trainer"]
