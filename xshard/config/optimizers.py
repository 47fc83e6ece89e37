"""Schemas of the ``optimizer`` group: the keyword arguments of the optax factory each option
names as ``_target_``, and the range rules of those arguments (`OPTIMIZER_RULES`).

Registered with the other groups' schemas by `xshard.config.schemas`. A value out of range
(``optimizer.b1=2``) is one `ConfigError` naming the key, the value and the allowed range, when
the node is read (`check_optimizer_args`, which the factory also applies to the arguments of an
outer optimizer). This module imports neither JAX nor optax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from xshard.config.ranges import FloatDtype, OneOf, Range, Rule, check_args

# --------------------------------------------------------------------------------------------
# optimizer/: keyword arguments of the optax factory named by `_target_`. `learning_rate` is
# the base (peak) rate that the schedule group shapes. Weight-decay masks are names resolved by
# xshard.build_optimizer (e.g. "no_bias_no_norm"), or null to decay every parameter.
# --------------------------------------------------------------------------------------------


_DECAY = "an exponential decay rate"
_STABILISER = "a constant added for numerical stability"

#: What each optimizer argument may be, by name. An argument means the same in every optax
#: optimizer that has it (adam's, lamb's and lion's `b1`; every `eps`), so each rule is written
#: once here; `check_optimizer_args` applies it to whichever optimizer the node builds (an
#: option of the group, or a ``_target_`` of one's own), and the schemas below to themselves.
OPTIMIZER_RULES: dict[str, Rule] = {
    "learning_rate": Range("the base (peak) learning rate", low_open=True),
    "b1": Range(f"{_DECAY} (first moment)", high=1.0),
    "b2": Range(f"{_DECAY} (second moment)", high=1.0),
    "momentum": Range(f"{_DECAY} (momentum)", high=1.0, nullable=True),
    "decay": Range(f"{_DECAY} (squared-gradient average)", high=1.0),
    "decay_rate": Range("the exponent of the second-moment decay schedule"),
    "decay_offset": Range("the step the decay schedule starts from", integer=True),
    "eps": Range(_STABILISER),
    "eps_root": Range(f"{_STABILISER} (inside the square root)"),
    "weight_decay": Range("the weight-decay strength"),
    "weight_decay_rate": Range("the weight-decay strength", nullable=True),
    "initial_accumulator_value": Range("the starting value of the squared-gradient sum"),
    "initial_scale": Range("the starting value of the squared-gradient average"),
    "trust_coefficient": Range("the trust-ratio scale", low_open=True),
    "clipping_threshold": Range("the update-clipping threshold", 1.0, nullable=True),
    "min_dim_size_to_factor": Range("the smallest dimension size to factor", integer=True),
    "mu_dtype": FloatDtype("the dtype of the first moment"),
    "accumulator_dtype": FloatDtype("the dtype of the momentum accumulator"),
    "dtype_momentum": FloatDtype("the dtype of the momentum", nullable=False),
    "state_dtype": FloatDtype("the dtype of the schedule-free z sequence"),
    # optax.contrib.muon: its Newton-Schulz orthogonalisation and its Adam fallback.
    "ns_steps": Range("the number of Newton-Schulz iterations", 1.0, integer=True),
    "beta": Range(f"{_DECAY} (momentum)", high=1.0),
    "preconditioning": OneOf(
        "the Newton-Schulz preconditioning", ("frobenius", "spectral", "aol", "schatten")
    ),
    "consistent_rms": Range("the RMS Muon's updates are scaled to", low_open=True, nullable=True),
    "adam_b1": Range(f"{_DECAY} (first moment of the Adam fallback)", high=1.0),
    "adam_b2": Range(f"{_DECAY} (second moment of the Adam fallback)", high=1.0),
    "adam_eps_root": Range(f"{_STABILISER} (inside the Adam fallback's square root)"),
    "adam_weight_decay": Range("the Adam fallback's weight-decay strength"),
    # optax.contrib.schedule_free_adamw.
    "warmup_steps": Range("the length of the linear warmup", integer=True, nullable=True),
    "weight_lr_power": Range("the power of the peak rate that weighs each average"),
}


def check_optimizer_args(args: Any) -> None:
    """Checks the ``optimizer`` node's arguments (a mapping) against `OPTIMIZER_RULES`.

    Raises:
      ConfigError: naming ``optimizer.<arg>``, the value and what is allowed.
    """
    check_args(OPTIMIZER_RULES, args, "optimizer")


@dataclass
class OptimizerConf:
    """Fields every optimizer option has."""

    _target_: str = MISSING
    learning_rate: float = MISSING

    def __post_init__(self) -> None:
        check_optimizer_args(vars(self))


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
class MuonConf(OptimizerConf):
    """optax.contrib.muon: Newton-Schulz-orthogonalised momentum for the parameters
    ``muon_mask`` names (a rule of `xshard.optim.muon_masks`), AdamW for the others; built as
    `xshard.optim.muon.muon` (optax's, each matrix orthogonalised whole under ZeRO)."""

    _target_: str = "xshard.optim.muon.muon"
    ns_steps: int = 5
    beta: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mask: str | None = "no_bias_no_norm"
    mu_dtype: str | None = None
    nesterov: bool = True
    adaptive: bool = False
    preconditioning: str = "frobenius"
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps_root: float = 0.0
    adam_weight_decay: float = 0.0
    consistent_rms: float | None = None
    muon_mask: str | None = "hidden_matrices"
    shard_orthogonalization: bool = True


@dataclass
class ScheduleFreeAdamWConf(OptimizerConf):
    """optax.contrib.schedule_free_adamw: evaluate (and export) its
    ``schedule_free_eval_params``, which the trainer does; `b1` must be > 0 and the schedule
    must not decay (`xshard.optim.schedule_free.check_schedule_free`)."""

    _target_: str = "optax.contrib.schedule_free_adamw"
    warmup_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_lr_power: float = 2.0
    state_dtype: str | None = None


@dataclass
class AdoptConf(OptimizerConf):
    _target_: str = "optax.contrib.adopt"
    b1: float = 0.9
    b2: float = 0.9999
    eps: float = 1e-6
    mu_dtype: str | None = None
    nesterov: bool = False
    use_clipping: bool = True


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
