"""The train step: what it updates, computes and is compiled into.

Its data (`types`: `TrainState`, `StepResult`, `TrainStep`, `StepSpec`), its levels (`levels`:
plain, statistics, per-layer norms, histograms, and which level each step of a run has), its
static description from a run's settings (`step_spec`), the optimizer as it runs it (`optimizer`),
the loss and gradient over microbatches (`grads`), the traced step function of one level
(`train_step`) with its ZeRO variants (`zero_update`), and the programs: one per kind of step,
lowered, compiled and dispatched by `programs.StepPrograms`.

The step's data and levels are importable from here.
"""

from trainers.core.step.levels import HISTOGRAMS, LAYERS, LEVELS, PLAIN, STATS
from trainers.core.step.types import StepResult, StepSpec, TrainState, TrainStep, step_rng

__all__ = [
    "HISTOGRAMS",
    "LAYERS",
    "LEVELS",
    "PLAIN",
    "STATS",
    "StepResult",
    "StepSpec",
    "TrainState",
    "TrainStep",
    "step_rng",
]
