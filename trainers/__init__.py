"""The generic pjit trainer for xshard and its built-in tasks."""

from trainers.step import StepMetrics, TrainState
from trainers.trainer import Hook, StopTraining, Trainer

__all__ = ["Hook", "StepMetrics", "StopTraining", "TrainState", "Trainer"]
