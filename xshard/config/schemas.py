"""Structured-config schemas of the config groups users compose: optimizer, schedule,
reduction, mesh. Registered in Hydra's ConfigStore by the ``xshard_searchpath`` plugin.

Each YAML option under ``conf/<group>`` starts from one of these dataclasses through its
defaults list and states only what differs from it, e.g. ``conf/optimizer/adamw.yaml``::

    defaults:
      - /xshard_schemas/optimizer@_here_: adamw
      - _self_
    learning_rate: 1e-3

so a typo in a key or a value of the wrong type (``reduction.skip_nonfinite=maybe``) fails at
composition, before any JAX code runs. Values out of range fail when the node is read: the
optimizer's arguments by `OPTIMIZER_RULES` (``optimizer.b1=2``), the reduction's in
`ReductionConf`. The schemas live in their own ConfigStore group
(``xshard_schemas/...``) so they never show up as options of the user-facing groups, e.g. in
an ``optimizer=glob(*)`` sweep.

Every default here equals the default of the function the node feeds (the optax factory,
`xshard.schedules`, `xshard.cross_shard`, `xshard.mesh_spec.mesh_spec`), except where
``DEVIATIONS`` says why not; ``tests/test_config_defaults.py`` checks that. This module imports
neither JAX nor optax: Hydra's plugin scan imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from xshard.config.axes import AxisReductionConf, check_axes
from xshard.config.nodes import shown
from xshard.errors import ConfigError
from xshard.reduction_args import axis_names, clip_norm, comm_dtype
from xshard.reduction_mode import Reduction

SCHEMA_GROUP = "xshard_schemas"

# --------------------------------------------------------------------------------------------
# optimizer/: keyword arguments of the optax factory named by `_target_`. `learning_rate` is
# the base (peak) rate that the schedule group shapes. Weight-decay masks are names resolved by
# xshard.build_optimizer (e.g. "no_bias_no_norm"), or null to decay every parameter.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """What an optimizer argument may be: a finite number (not a bool) from `low` (inclusive
    unless `low_open`) up to `high` (exclusive; None: no bound); null too if `nullable`."""

    what: str
    low: float = 0.0
    high: float | None = None
    low_open: bool = False
    nullable: bool = False
    integer: bool = False

    def check(self, value: Any, key: str) -> None:
        """Raises `ConfigError` naming `key` and `value` if `value` is not allowed."""
        if value is None and self.nullable:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, int if self.integer else int | float)
            or not math.isfinite(value)
            or value < self.low
            or (self.low_open and value == self.low)
            or (self.high is not None and value >= self.high)
        ):
            kind = "an integer" if self.integer else "a number"
            if self.high is None:
                allowed = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
            else:
                name = key.rsplit(".", 1)[-1]
                allowed = f"{kind} with {self.low:g} <= {name} < {self.high:g}"
            null = ", or null for none" if self.nullable else ""
            raise ConfigError(f"{key}={shown(value)}: expected {self.what}, {allowed}{null}.")


_DECAY = "an exponential decay rate"
_STABILISER = "a constant added for numerical stability"

#: What each optimizer argument may be, by name. An argument means the same in every optax
#: optimizer that has it (adam's, lamb's and lion's `b1`; every `eps`), so each rule is written
#: once here; `check_optimizer_args` applies it to whichever optimizer the node builds (an
#: option of the group, or a ``_target_`` of one's own), and the schemas below to themselves.
OPTIMIZER_RULES: dict[str, Range] = {
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
}


def check_optimizer_args(args: Any) -> None:
    """Checks the ``optimizer`` node's arguments (a mapping) against `OPTIMIZER_RULES`.

    Raises:
      ConfigError: naming ``optimizer.<arg>``, the value and what is allowed.
    """
    for name, value in args.items():
        rule = OPTIMIZER_RULES.get(name)
        if rule is not None:
            rule.check(value, f"optimizer.{name}")


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


# --------------------------------------------------------------------------------------------
# reduction/: the keyword arguments of xshard.cross_shard (`mode` is its `reduction`).
# --------------------------------------------------------------------------------------------


@dataclass
class ReductionConf:
    """How gradients are combined across data-parallel shards (see `xshard.cross_shard`)."""

    mode: str = "mean"  # "sum" or "mean", any case; read as a `xshard.Reduction`
    axis_name: Any = None  # a mesh axis or a list of them; null: the mesh's data axes
    clip_per_shard: float | None = None  # clip each shard's gradient to this global norm
    comm_dtype: str | None = None  # dtype of the all-reduce, e.g. bfloat16
    skip_nonfinite: bool = True  # a NaN/Inf reduced gradient skips the step on every shard
    # Per mesh axis: how often, in how many bits, by what rule (xshard.config.axes).
    axes: dict[str, AxisReductionConf] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Validated and parsed here, once: `xshard.cross_shard` receives the `Reduction`.
        try:
            self.mode = Reduction.parse(self.mode, key="reduction.mode")
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in Reduction)
            raise ConfigError(
                f"Unsupported reduction.mode: {shown(self.mode)}. Allowed: {allowed} (any case)."
            ) from None
        # The rules of the library's keywords, with the config's keys in their messages.
        if self.axis_name is not None:
            self.axis_name = axis_names(self.axis_name, key="reduction.axis_name")
        self.clip_per_shard = clip_norm(self.clip_per_shard, key="reduction.clip_per_shard")
        self.comm_dtype = comm_dtype(self.comm_dtype, key="reduction.comm_dtype")
        check_axes(self.axes)


# --------------------------------------------------------------------------------------------
# mesh/: read by xshard.mesh_spec.mesh_spec, whose defaults fill whatever is null here.
# --------------------------------------------------------------------------------------------


@dataclass
class MeshConf:
    """A device mesh: axes and their sizes within a slice (ici) and across slices (dcn)."""

    name: str | None = None
    topology: str | None = None  # e.g. 2x2x1; informational
    num_devices: int | None = None  # null: whatever JAX sees
    axes: list[str] = field(default_factory=lambda: ["data"])
    ici: list[int] | None = None  # null: -1 on the first axis, 1 elsewhere
    dcn: list[int] | None = None  # null: 1 on every axis
    axis_types: Any = "auto"  # auto | explicit, or one per axis
    simulate_on_cpu: bool = False  # dry-run on num_devices simulated CPU devices
    data_axes: list[str] | None = None  # null: the first axis


@dataclass
class TPUMeshConf(MeshConf):
    """The base of the TPU presets: data parallelism, and a model axis of size 1 to widen."""

    axes: list[str] = field(default_factory=lambda: ["data", "model"])
    ici: list[int] | None = field(default_factory=lambda: [-1, 1])
    dcn: list[int] | None = field(default_factory=lambda: [1, 1])


def reduction_kwargs(conf: ReductionConf) -> dict[str, Any]:
    """`conf` as keyword arguments of `xshard.cross_shard` (``mode`` is its ``reduction``),
    without ``axes``: `xshard.factory` turns those into `xshard.AxisRule`s."""
    kwargs = dict(vars(conf))
    kwargs["reduction"] = kwargs.pop("mode")
    del kwargs["axes"]
    return kwargs


#: Where a schema default differs from the default of the function it feeds, and why.
DEVIATIONS: dict[str, str] = {
    "weight_decay_mask": "xshard decays no biases, norm scales or 0-D/1-D params by default",
    "trust_ratio_mask": "as weight_decay_mask: no trust ratio for biases and norm scales",
    "dtype_momentum": "a dtype name in YAML ('float32') for optax's jnp.float32",
    "skip_nonfinite": (
        "the trainer skips non-finite steps by default; the library's cross_shard does not "
        "(as TF's CrossShardOptimizer, and so that it is exactly the inner optimizer)"
    ),
    "axis_name": "null: the mesh's data axes, which the library cannot know",
    "axes": (
        "per-axis rules: the every-step ones go to cross_shard, the periodic one (local SGD, "
        "DiLoCo) to the trainer's sync step (xshard.factory.build_axis_rules)"
    ),
}


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
    "mesh": {"base": MeshConf, "tpu": TPUMeshConf},
}


def register_schemas(cs: ConfigStore | None = None, schemas: dict[str, Any] | None = None) -> None:
    """Stores every schema as ``xshard_schemas/<group>/<name>`` (idempotent).

    Args:
      cs: the ConfigStore (Hydra's instance by default).
      schemas: ``{group: {name: dataclass}}`` (default `SCHEMAS`, the library's groups).
    """
    cs = cs or ConfigStore.instance()
    for group, options in (SCHEMAS if schemas is None else schemas).items():
        for name, node in options.items():
            cs.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=node, provider="xshard")
