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

from typing import Any, NamedTuple

# The codecs a rule may name (``comm_dtype``); xshard.codecs implements exactly these.
CODEC_NAMES: tuple[str, ...] = ("float32", "bfloat16", "int8", "float8_e4m3fn")
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
        """Whether the axis syncs parameters in a separate step instead of reducing gradients."""
        return self.every_steps > 1 or self.outer_optimizer is not None
