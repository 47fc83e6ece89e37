"""Schemas of the ``schedule`` group and the rules of their arguments (`SCHEDULE_RULES`).

Each option names a factory of `xshard.schedules` as ``_target_``; the factory takes the
optimizer's ``learning_rate`` as the peak, and every ``*_factor`` is a fraction of it, so
changing the rate rescales the whole curve. An argument means the same in every schedule that
has it (every ``end_factor``, every ``warmup_steps``), so its rule is written once, here, and
read by the schemas, by `xshard.optim.factory` (whatever the node's ``_target_``, as
``schedule.<arg>``) and by the factories of `xshard.schedules` (as ``<arg>``). Registered with
the other groups' schemas by `xshard.config.schemas`. JAX-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from xshard.config.ranges import Range, check_args

_FACTOR = "a fraction of optimizer.learning_rate"

#: What each schedule argument may be, by name (the learning rate is the optimizer's).
SCHEDULE_RULES: dict[str, Range] = {
    "decay_steps": Range("the schedule's length in steps, warmup included", 1, integer=True),
    "warmup_steps": Range("steps of linear warmup (0: none)", integer=True),
    "transition_steps": Range("steps per decay_rate factor", 1, integer=True),
    "init_factor": Range(f"the first rate of the warmup, {_FACTOR}", high=1.0, high_closed=True),
    "end_factor": Range(f"the final rate, {_FACTOR}", nullable=True),
    "exponent": Range("the exponent of the cosine (1: the usual half cosine)", low_open=True),
    "decay_rate": Range(
        "the factor per transition_steps (< 1 decays)",
        low_open=True,
        structural="optax.exponential_decay branches on it in Python (== 0, < 1)",
    ),
}


def check_schedule_args(args: Any, prefix: str = "schedule") -> None:
    """Checks a schedule's arguments (a mapping) against `SCHEDULE_RULES`, as
    ``<prefix>.<arg>`` (no prefix: the bare argument names of `xshard.schedules`).

    Raises:
      ConfigError: naming the first bad key, its value and what is allowed.
    """
    check_args(SCHEDULE_RULES, args, prefix)


@dataclass
class ScheduleConf:
    """Fields every schedule option has."""

    _target_: str = MISSING

    def __post_init__(self) -> None:
        check_schedule_args(vars(self))


@dataclass
class ConstantScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.constant"


@dataclass
class CosineScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.cosine"
    decay_steps: int = MISSING
    end_factor: float = 0.0
    exponent: float = 1.0


@dataclass
class WarmupLinearScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.warmup_linear"
    warmup_steps: int = MISSING
    decay_steps: int = MISSING
    init_factor: float = 0.0
    end_factor: float = 0.0


@dataclass
class WarmupCosineScheduleConf(WarmupLinearScheduleConf):
    _target_: str = "xshard.schedules.warmup_cosine"
    exponent: float = 1.0


@dataclass
class ExponentialScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.exponential"
    transition_steps: int = MISSING
    decay_rate: float = MISSING
    warmup_steps: int = 0
    staircase: bool = False
    end_factor: float | None = None
