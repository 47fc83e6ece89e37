"""The ``reduction.axes.<axis name>`` schema: how one mesh axis reduces (`xshard.AxisRule`).

A node per axis, keyed by the mesh axis name::

    reduction:
      axes:
        slice:                 # the DCN axis of mesh=cpu2x4_slices
          every_steps: 8       # periodic: replicas over `slice` train alone for 8 steps
          outer_optimizer:     # then the pseudo-gradient goes through this optax optimizer
            _target_: optax.sgd
            learning_rate: 0.7
            momentum: 0.9
            nesterov: true
          comm_dtype: int8     # the codec of what crosses the axis (xshard.axis_rules)
          error_feedback: true # the codec's residual is kept and added to the next message

Every rule that needs no mesh is checked here, once, when the node is read
(`AxisReductionConf.check`); those that need the mesh (the axis exists, is a data axis, has a
power-of-two size for Adasum) in `xshard.factory`, which also builds the outer optimizer. Each
error is one line naming the key, the value and what is allowed. JAX-free, like every schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xshard.axis_rules import CODEC_NAMES, RULE_NAMES
from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: The rules a periodic axis may reduce its pseudo-gradient by.
PERIODIC_RULES = ("mean",)


@dataclass
class AxisReductionConf:
    """How one mesh axis reduces (the fields of `xshard.AxisRule`; docs/reductions.md).

    A node with an ``outer_optimizer`` is *periodic* (local SGD, DiLoCo): replicas over the
    axis train alone and every ``every_steps`` steps a sync step reduces the pseudo-gradient
    (outer params minus replica params) and applies the outer optimizer. Without one the axis
    reduces the gradient every step, by ``rule`` and in ``comm_dtype``.
    """

    every_steps: int = 1  # steps between syncs of a periodic axis
    outer_optimizer: Any = None  # an optax `_target_` node; set: the axis is periodic
    comm_dtype: str | None = None  # codec of what crosses the axis, one of CODEC_NAMES
    error_feedback: bool = False  # keep the codec's residual and add it to the next message
    fragments: int = 1  # Streaming DiLoCo: parameter fragments synced on a staggered schedule
    rule: str | None = None  # mean, sum or adasum; null: the reduction's mode
    warmup_steps: int = 0  # synchronous steps before the first local one (start_localSGD_iter)

    @property
    def periodic(self) -> bool:
        """Whether the axis syncs parameters in a separate step (it has an outer optimizer)."""
        return self.outer_optimizer is not None

    def check(self, key: str) -> None:
        """Checks the rules that need no mesh; `key` is the node's (``reduction.axes.slice``).

        Raises:
          ConfigError: naming the first bad key, its value and what is allowed.
        """
        self._check_counts(key)
        if self.comm_dtype is not None and self.comm_dtype not in CODEC_NAMES:
            raise ConfigError(
                f"{key}.comm_dtype={shown(self.comm_dtype)}: expected null or a codec, one of "
                f"{list(CODEC_NAMES)}."
            )
        if self.rule is not None and self.rule not in RULE_NAMES:
            raise ConfigError(
                f"{key}.rule={shown(self.rule)}: expected null or one of {list(RULE_NAMES)}."
            )
        if self.error_feedback and self.comm_dtype is None:
            raise ConfigError(
                f"{key}.error_feedback=true needs {key}.comm_dtype (a codec, one of "
                f"{list(CODEC_NAMES)}): without one nothing is lost to feed back."
            )
        if self.periodic:
            self._check_periodic(key)
        else:
            self._check_every_step(key)

    def _check_counts(self, key: str) -> None:
        for name, low in (("every_steps", 1), ("fragments", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}.{name}={shown(value)}: expected an integer >= {low}.")
        if self.fragments > self.every_steps:
            raise ConfigError(
                f"{key}.fragments={self.fragments}: expected at most {key}.every_steps="
                f"{self.every_steps} (each fragment syncs once per period, on its own step)."
            )

    def _check_periodic(self, key: str) -> None:
        node = self.outer_optimizer
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
            raise ConfigError(
                f"{key}.outer_optimizer={shown(node)}: expected null or an optax optimizer "
                "node with a _target_, e.g. {_target_: optax.sgd, learning_rate: 1.0} "
                "(parameter averaging)."
            )
        if self.rule is not None and self.rule not in PERIODIC_RULES:
            raise ConfigError(
                f"{key}.rule={shown(self.rule)}: a periodic axis (with {key}.outer_optimizer) "
                f"reduces its pseudo-gradient by one of {list(PERIODIC_RULES)} or null."
            )

    def _check_every_step(self, key: str) -> None:
        for name, default in (("every_steps", 1), ("fragments", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if value != default:
                raise ConfigError(
                    f"{key}.{name}={value}: only a periodic axis has it; set {key}."
                    "outer_optimizer (e.g. {_target_: optax.sgd, learning_rate: 1.0}, "
                    f"parameter averaging), or {key}.{name}={default}."
                )


def check_axes(axes: Any, key: str = "reduction.axes") -> None:
    """Checks every node of ``reduction.axes`` (read as `AxisReductionConf`s) by its key.

    Raises:
      ConfigError: for the first bad node, naming its key, and for more than one periodic
        axis (one periodic axis per run: its replicas hold one copy of the params each).
    """
    for name, conf in axes.items():
        conf.check(f"{key}.{name}")
    periodic = [name for name, conf in axes.items() if conf.periodic]
    if len(periodic) > 1:
        raise ConfigError(
            f"{key}: {periodic} are all periodic (have an outer_optimizer); one periodic axis "
            "per run is supported."
        )
