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
          comm_dtype: int8     # the codec of what crosses the axis (xshard.config.axis_rules)
          error_feedback: true # the codec's residual is kept and added to the next message

Every rule that needs no mesh is checked here, once, when the node is read
(`AxisReductionConf.check`); those that need the mesh (the axis exists, is a data axis, has a
power-of-two size for Adasum) in `xshard.optim.factory`, which also builds the outer optimizer. Each
error is one line naming the key, the value and what is allowed. JAX-free, like every schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xshard.config.axis_rules import check_rule, check_rules
from xshard.config.nodes import shown
from xshard.errors import ConfigError


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
        """Checks the rules that need no mesh; `key` is the node's (``reduction.axes.slice``):
        the outer optimizer is a node with a ``_target_``, and the rules `xshard.cross_shard`
        checks too (`xshard.config.axis_rules.check_rule`, written once there).

        Raises:
          ConfigError: naming the first bad key, its value and what is allowed.
        """
        node = self.outer_optimizer
        has_target = isinstance(node, dict) and isinstance(node.get("_target_"), str)
        if node is not None and not has_target:
            raise ConfigError(
                f"{key}.outer_optimizer={shown(node)}: expected null or an optax optimizer "
                "node with a _target_, e.g. {_target_: optax.sgd, learning_rate: 1.0} "
                "(parameter averaging)."
            )
        check_rule(self, key)


def check_axes(axes: Any, key: str = "reduction.axes") -> None:
    """Checks every node of ``reduction.axes`` (read as `AxisReductionConf`s) by its key, and
    the set of them (`xshard.config.axis_rules.check_rules`: one periodic axis, one every-step
    rule).

    Raises:
      ConfigError: for the first bad node or key, naming it.
    """
    for name, conf in axes.items():
        conf.check(f"{key}.{name}")
    check_rules(axes, key)
