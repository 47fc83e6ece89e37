"""Structured-config schemas of xshard's config groups, registered in Hydra's ConfigStore.

Each YAML option under ``conf/optimizer``, ``conf/schedule`` and ``conf/reduction`` starts
from one of these dataclasses through its defaults list, e.g.::

    defaults:
      - /xshard_schemas/optimizer@_here_: adamw
      - _self_

so a typo in a key or a value of the wrong type (``reduction.skip_nonfinite=maybe``) fails at
composition, before any JAX code runs. The schemas live in their own ConfigStore group
(``xshard_schemas/...``) so they never show up as options of the user-facing groups, e.g. in
an ``optimizer=glob(*)`` sweep.

This module is imported by the plugin module next to it during Hydra's plugin discovery. It
must import neither JAX nor the ``xshard`` package (whose ``__init__`` imports JAX). Its name
starts with ``_`` so that Hydra's plugin scan does not execute it a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SCHEMA_GROUP = "xshard_schemas"

# --------------------------------------------------------------------------------------------
# optimizer/: keyword arguments of the optax factory named by `_target_`. `learning_rate` is
# the base (peak) rate that the schedule group shapes. Weight-decay masks are names resolved by
# xshard.build_optimizer (e.g. "no_bias_no_norm"), or null to decay every parameter.
# --------------------------------------------------------------------------------------------


@dataclass
class OptimizerConf:
    """Fields every optimizer option has."""

    _target_: str = MISSING
    learning_rate: float = MISSING


@dataclass
class SGDConf(OptimizerConf):
    _target_: str = "optax.sgd"
    momentum: float | None = None
    nesterov: bool = False
    accumulator_dtype: str | None = None


@dataclass
class AdamConf(OptimizerConf):
    _target_: str = "optax.adam"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    mu_dtype: str | None = None
    nesterov: bool = False


@dataclass
class AdamWConf(AdamConf):
    _target_: str = "optax.adamw"
    weight_decay: float = 1e-4
    weight_decay_mask: str | None = "no_bias_no_norm"


@dataclass
class LambConf(OptimizerConf):
    _target_: str = "optax.lamb"
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    eps_root: float = 0.0
    weight_decay: float = 0.0
    weight_decay_mask: str | None = "no_bias_no_norm"


@dataclass
class LarsConf(OptimizerConf):
    _target_: str = "optax.lars"
    weight_decay: float = 0.0
    weight_decay_mask: str | None = "no_bias_no_norm"
    trust_coefficient: float = 0.001
    eps: float = 0.0
    trust_ratio_mask: str | None = "no_bias_no_norm"
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class LionConf(OptimizerConf):
    _target_: str = "optax.lion"
    b1: float = 0.9
    b2: float = 0.99
    mu_dtype: str | None = None
    weight_decay: float = 1e-3
    weight_decay_mask: str | None = "no_bias_no_norm"


@dataclass
class AdafactorConf(OptimizerConf):
    _target_: str = "optax.adafactor"
    min_dim_size_to_factor: int = 128
    decay_rate: float = 0.8
    decay_offset: int = 0
    multiply_by_parameter_scale: bool = True
    clipping_threshold: float | None = 1.0
    momentum: float | None = None
    dtype_momentum: str = "float32"
    weight_decay_rate: float | None = None
    eps: float = 1e-30
    factored: bool = True
    weight_decay_mask: str | None = "no_bias_no_norm"


@dataclass
class RMSPropConf(OptimizerConf):
    _target_: str = "optax.rmsprop"
    decay: float = 0.9
    eps: float = 1e-8
    initial_scale: float = 0.0
    eps_in_sqrt: bool = True
    centered: bool = False
    momentum: float | None = None
    nesterov: bool = False
    bias_correction: bool = False


@dataclass
class AdagradConf(OptimizerConf):
    _target_: str = "optax.adagrad"
    initial_accumulator_value: float = 0.1
    eps: float = 1e-7


# --------------------------------------------------------------------------------------------
# schedule/: factories in xshard.schedules. Each takes the optimizer's learning_rate as the
# peak; `*_factor` values are fractions of it, so changing the rate rescales the whole curve.
# --------------------------------------------------------------------------------------------


@dataclass
class ScheduleConf:
    """Fields every schedule option has."""

    _target_: str = MISSING


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
class WarmupCosineScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.warmup_cosine"
    warmup_steps: int = MISSING
    decay_steps: int = MISSING
    init_factor: float = 0.0
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
class ExponentialScheduleConf(ScheduleConf):
    _target_: str = "xshard.schedules.exponential"
    transition_steps: int = MISSING
    decay_rate: float = MISSING
    warmup_steps: int = 0
    staircase: bool = False
    end_factor: float | None = None


# --------------------------------------------------------------------------------------------
# reduction/: arguments of xshard.cross_shard.
# --------------------------------------------------------------------------------------------


@dataclass
class ReductionConf:
    """How gradients are combined across data-parallel shards (see xshard.cross_shard)."""

    mode: str = "mean"  # "sum" or "mean"
    axis_name: Any = "data"  # a mesh axis name, or a list of them
    clip_per_shard: float | None = None
    comm_dtype: str | None = None  # e.g. "bfloat16"
    skip_nonfinite: bool = True


SCHEMAS: dict[str, dict[str, type]] = {
    "optimizer": {
        "sgd": SGDConf,
        "adam": AdamConf,
        "adamw": AdamWConf,
        "lamb": LambConf,
        "lars": LarsConf,
        "lion": LionConf,
        "adafactor": AdafactorConf,
        "rmsprop": RMSPropConf,
        "adagrad": AdagradConf,
    },
    "schedule": {
        "constant": ConstantScheduleConf,
        "cosine": CosineScheduleConf,
        "warmup_cosine": WarmupCosineScheduleConf,
        "warmup_linear": WarmupLinearScheduleConf,
        "exponential": ExponentialScheduleConf,
    },
    "reduction": {"base": ReductionConf},
}


def register_schemas(cs: ConfigStore | None = None) -> None:
    """Stores every schema as ``xshard_schemas/<group>/<name>`` (idempotent)."""
    cs = cs or ConfigStore.instance()
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=node, provider="xshard")
