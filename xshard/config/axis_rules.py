"""Per-mesh-axis reduction rules: how often, in how many bits and by what rule data crosses an axis.

A synchronous mean over every data axis at every step is what XLA already does best. An
`AxisRule` lets one named mesh axis (e.g. the DCN axis ``slice`` of a multi-slice mesh) choose
otherwise:

- **when**: ``every_steps`` and ``outer_optimizer`` make the axis *periodic* (local SGD,
  DiLoCo): replicas over the axis train alone and a separate sync step reduces the
  pseudo-gradient (outer params minus replica params) and applies the outer optax optimizer;
- **how many bits**: ``comm_dtype`` names the codec of what crosses the axis, and
  ``error_feedback`` keeps the codec's residual in state and adds it to the next message;
- **by what rule**: ``rule`` is ``mean``, ``sum`` or ``adasum`` (None: the reduction's mode).

This module is JAX-free (the config schemas read the allowed names from here); the codecs,
Adasum and the periodic sync live in the modules that use these rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from xshard.config.nodes import shown
from xshard.config.ranges import Range
from xshard.errors import ConfigError

# The codecs a rule may name (``comm_dtype``); xshard.reduce.codecs implements exactly these.
CODEC_NAMES: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4", "float8_e4m3fn")
# The rules by which an axis combines what its replicas send.
RULE_NAMES: tuple[str, ...] = ("mean", "sum", "adasum")


class AxisRule(NamedTuple):
    """How one mesh axis reduces: when, in how many bits, by what rule.

    Attributes:
      every_steps: steps between syncs of a periodic axis (1: every step).
      outer_optimizer: the optax optimizer a periodic axis applies to the reduced
        pseudo-gradient (None with ``every_steps == 1``: the axis reduces gradients every step).
      comm_dtype: codec name of what crosses the axis (one of `CODEC_NAMES`), None for none.
      error_feedback: keep the codec's residual in state and add it to the next message.
      fragments: parameter fragments a periodic axis syncs on a staggered schedule.
      rule: ``mean``, ``sum`` or ``adasum`` (one of `RULE_NAMES`); None: the reduction's mode.
      warmup_steps: synchronous steps of a periodic axis before its replicas train alone
        (PyTorch's ``start_localSGD_iter``): until then the gradient is reduced over the axis
        every step too.
    """

    every_steps: int = 1
    outer_optimizer: Any = None
    comm_dtype: str | None = None
    error_feedback: bool = False
    fragments: int = 1
    rule: str | None = None
    warmup_steps: int = 0

    @property
    def periodic(self) -> bool:
        """Whether the axis syncs parameters in a separate step instead of reducing gradients
        (it has an outer optimizer; `check_rule` refuses the periodic fields without one)."""
        return self.outer_optimizer is not None


#: The rules a periodic axis may reduce its pseudo-gradient by.
PERIODIC_RULES: tuple[str, ...] = ("mean",)
#: The fields only a periodic axis has, with the value that means "not periodic".
_PERIODIC_ONLY = (("every_steps", 1), ("fragments", 1), ("warmup_steps", 0))
#: The integer fields and their ranges (bounded by the int32 step counter).
_COUNTS = {
    "every_steps": Range("the steps between syncs (1: every step)", 1, integer=True),
    "fragments": Range("the parameter fragments synced in turn", 1, integer=True),
    "warmup_steps": Range("the synchronous steps before the first local one", integer=True),
}
#: What the first ``outer_optimizer`` could be, for the messages.
_AVERAGING = "{_target_: optax.sgd, learning_rate: 1.0} (parameter averaging)"


class RuleFields(Protocol):
    """What `check_rule` reads: an `AxisRule`, or the config node it is read from
    (`xshard.config.axes.AxisReductionConf`, whose ``outer_optimizer`` is still a node)."""

    @property
    def every_steps(self) -> Any: ...

    @property
    def outer_optimizer(self) -> Any: ...

    @property
    def comm_dtype(self) -> Any: ...

    @property
    def error_feedback(self) -> Any: ...

    @property
    def fragments(self) -> Any: ...

    @property
    def rule(self) -> Any: ...

    @property
    def warmup_steps(self) -> Any: ...


def check_rule(rule: RuleFields, key: str) -> None:
    """Checks one axis's rule on its own, for `xshard.cross_shard` (``axes.<axis>``) and the
    config (``reduction.axes.<axis>``) alike: the one place these rules are written.

    Args:
      rule: the rule's fields.
      key: its name in the messages, e.g. ``reduction.axes.slice``.

    Raises:
      ConfigError: (a ValueError) naming ``<key>.<field>``, its value and what is allowed.
    """
    for name, count in _COUNTS.items():
        count.check(getattr(rule, name), f"{key}.{name}")
    if rule.fragments > rule.every_steps:
        raise ConfigError(
            f"{key}.fragments={rule.fragments}: expected at most {key}.every_steps="
            f"{rule.every_steps} (each fragment syncs once per period, on its own step)."
        )
    if rule.comm_dtype is not None and rule.comm_dtype not in CODEC_NAMES:
        raise ConfigError(
            f"{key}.comm_dtype={shown(rule.comm_dtype)}: expected null or a codec, one of "
            f"{list(CODEC_NAMES)}."
        )
    if rule.rule is not None and rule.rule not in RULE_NAMES:
        raise ConfigError(
            f"{key}.rule={shown(rule.rule)}: expected null or one of {list(RULE_NAMES)}."
        )
    if rule.error_feedback and rule.comm_dtype is None:
        raise ConfigError(
            f"{key}.error_feedback=true needs {key}.comm_dtype (a codec, one of "
            f"{list(CODEC_NAMES)}): without one nothing is lost to feed back."
        )
    if rule.outer_optimizer is not None:
        if rule.rule is not None and rule.rule not in PERIODIC_RULES:
            raise ConfigError(
                f"{key}.rule={shown(rule.rule)}: a periodic axis (with {key}.outer_optimizer) "
                f"reduces its pseudo-gradient by one of {list(PERIODIC_RULES)} or null."
            )
        return
    for name, default in _PERIODIC_ONLY:
        value = getattr(rule, name)
        if value != default:
            raise ConfigError(
                f"{key}.{name}={value}: only a periodic axis has it; set {key}.outer_optimizer "
                f"(e.g. {_AVERAGING}), or {key}.{name}={default}."
            )
    if rule.rule == "adasum" and rule.comm_dtype not in (None, "float32"):
        raise ConfigError(
            f"{key}.comm_dtype={shown(rule.comm_dtype)}: rule adasum runs in float32 on the "
            f"wire; set {key}.comm_dtype to null or float32, or {key}.rule to mean or sum."
        )


def check_rules(rules: Mapping[str, RuleFields], key: str) -> None:
    """Checks every axis's rule (`check_rule`, as ``<key>.<axis>``) and the set of them: one
    periodic axis at most (its replicas hold one copy of the params each), one every-step rule
    at most (a first axis's error-feedback state would vary over the second).

    Raises:
      ConfigError: naming the first bad key.
    """
    for axis, rule in rules.items():
        check_rule(rule, f"{key}.{axis}")
    periodic = [axis for axis, rule in rules.items() if rule.outer_optimizer is not None]
    if len(periodic) > 1:
        raise ConfigError(
            f"{key}: {periodic} are all periodic (have an outer_optimizer); one periodic axis "
            "per run is supported."
        )
    every = [axis for axis, rule in rules.items() if rule.outer_optimizer is None]
    if len(every) > 1:
        raise ConfigError(
            f"{key}: {every} all reduce by their own rule every step; at most one axis may "
            "(the others reduce by reduction.mode; give one of them an outer_optimizer or "
            "remove it)."
        )


def inner_data_axes(
    data_axes: Sequence[str], periodic: str | None, key: str = "reduction.axes"
) -> tuple[str, ...]:
    """The data axes a replica reduces its gradient over every step: all of them but the
    periodic axis (`periodic`; None: there is none). The one place a periodic axis is checked
    against the data axes, for the config and for a `Trainer` built in Python alike.

    Raises:
      ConfigError: naming ``<key>.<periodic>``, for a periodic axis that is not a data axis or
        is the only one.
    """
    data_axes = tuple(data_axes)
    if periodic is None:
        return data_axes
    inner = tuple(a for a in data_axes if a != periodic)
    if periodic not in data_axes or not inner:
        raise ConfigError(
            f"{key}.{periodic}: a periodic axis must be a data axis and not the only one (its "
            "replicas train on their own data and reduce their gradient over the others every "
            f"step), mesh.data_axes={list(data_axes)}."
        )
    return inner
