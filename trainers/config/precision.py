"""How a run computes: the ``precision`` node and the names of ``trainer.remat``. JAX-free.

``precision`` (the config group: ``precision=fp32``, the default, or ``precision=bf16``):

- ``param_dtype``: the dtype the params are stored and updated in (the master params; the
  optimizer state follows them, checkpoints hold them);
- ``compute_dtype``: the dtype of the forward and backward passes. The trainer casts the params
  to it inside the step, so the gradient arrives in ``param_dtype`` through the cast; the loss,
  the gradient statistics, the non-finite guard and the cross-shard reduction stay float32
  (unless ``reduction.comm_dtype`` says otherwise).

``trainer.remat`` names a rematerialisation policy (`REMAT_POLICIES`): what a layer keeps of
its forward pass for the backward one; the rest is recomputed. The names other than ``none``
and ``full`` are the argument-free policies of ``jax.checkpoint_policies`` (a test checks that
each one is there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xshard.config.nodes import read_node, shown
from xshard.errors import ConfigError

#: Floating-point dtypes the params and the computation may have.
DTYPES = ("float32", "bfloat16")

#: ``trainer.remat``: ``none`` keeps every activation; ``full`` recomputes each layer's forward
#: pass in the backward (``jax.checkpoint`` without a policy); the others are the policies of
#: ``jax.checkpoint_policies`` of that name (which values a layer saves: e.g. ``dots_saveable``
#: the results of matrix multiplications).
REMAT_POLICIES = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
    "everything_saveable",
)
NO_REMAT = REMAT_POLICIES[0]


def check_remat(value: Any, key: str = "trainer.remat") -> str:
    """Returns `value` if it names a rematerialisation policy of `REMAT_POLICIES`.

    Raises:
      ConfigError: naming `key`, the value and the allowed names.
    """
    if value not in REMAT_POLICIES:
        raise ConfigError(
            f"{key}={shown(value)} is not a rematerialisation policy; choose one of "
            f"{list(REMAT_POLICIES)}."
        )
    return str(value)


def check_dtype(value: Any, key: str) -> str:
    """Returns `value` if it is one of `DTYPES`.

    Raises:
      ConfigError: naming `key`, the value and the allowed dtypes.
    """
    if value not in DTYPES:
        raise ConfigError(f"{key}={shown(value)} is not allowed; choose one of {list(DTYPES)}.")
    return str(value)


@dataclasses.dataclass(frozen=True)
class PrecisionOptions:
    """The ``precision`` node (module docstring).

    Attributes:
      param_dtype: the params' (and so the optimizer state's and the checkpoints') dtype.
      compute_dtype: the dtype of the forward and backward passes.
    """

    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    @classmethod
    def from_config(cls, node: Any) -> PrecisionOptions:
        """Reads the ``precision`` node (`read_node`: one-line errors naming the key); an
        absent node gives the defaults (float32 throughout)."""
        return read_node(cls, {} if node is None else node, "precision")

    def __post_init__(self) -> None:
        check_dtype(self.param_dtype, "precision.param_dtype")
        check_dtype(self.compute_dtype, "precision.compute_dtype")

    @property
    def mixed(self) -> bool:
        """Whether the computation runs in another dtype than the params are kept in."""
        return self.param_dtype != self.compute_dtype
