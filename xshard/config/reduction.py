"""The rules of `xshard.cross_shard`'s reduction arguments, its mode among them, without JAX.

Each argument has one rule for both of its ways in: the library's keyword
(``cross_shard(inner, "mean", axis_name=..., clip_per_shard=..., comm_dtype=...)``) and the
config's ``reduction.*`` key, whose schema (`xshard.config.schemas.ReductionConf`) must stay
importable without JAX (Hydra's plugin scan imports it). Each rule checks and parses a value
once; the error names `key` (the keyword, or the config key), the value and what is allowed.
The mode is `Reduction` (`Reduction.parse`); the schema parses the config's string once and
hands on a `Reduction`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from xshard.config.nodes import shown
from xshard.config.ranges import FLOAT_DTYPES, Range
from xshard.errors import ConfigError

#: Dtypes the all-reduce may run in (``comm_dtype``): floating ones, cast back after.
COMM_DTYPES = FLOAT_DTYPES
#: A per-shard clip: a finite norm (inf would be no clip, nan every gradient lost), or none.
_CLIP_NORM = Range("a global norm to clip each shard's gradient to", low_open=True, nullable=True)


def axis_names(value: str | Sequence[str], *, key: str = "axis_name") -> tuple[str, ...]:
    """`value`, a mesh axis name or a sequence of them, as a tuple of distinct names.

    Raises:
      ConfigError: for an empty name or list, a non-string, or duplicates.
    """
    names = [value] if isinstance(value, str) else value
    if (
        not isinstance(names, list | tuple)
        or not names
        or not all(isinstance(a, str) and a for a in names)
        or len(set(names)) != len(names)
    ):
        raise ConfigError(
            f"{key}={shown(value)}: expected a mesh axis name or a list of distinct names, "
            "e.g. data or [dcn_data, data] (in a config, null: the mesh's data axes)."
        )
    return tuple(names)


def clip_norm(value: Any, *, key: str = "clip_per_shard") -> float | None:
    """`value`, None or a global norm > 0 to clip each shard's gradient to.

    Raises:
      ConfigError: for anything else (a bool, a string, a norm <= 0, inf or nan).
    """
    _CLIP_NORM.check(value, key)
    return None if value is None else float(value)


def comm_dtype(value: Any, *, key: str = "comm_dtype") -> str | None:
    """The name of `value`, None or a floating dtype of `COMM_DTYPES` (a name, a NumPy dtype
    or a JAX scalar type such as ``jnp.bfloat16``).

    Raises:
      ConfigError: for another dtype or anything else.
    """
    if value is None:
        return None
    name = value if isinstance(value, str) else getattr(value, "name", None)
    name = name if isinstance(name, str) else getattr(value, "__name__", None)
    if name not in COMM_DTYPES:
        raise ConfigError(
            f"{key}={shown(value)}: expected null or a floating dtype name, one of "
            f"{list(COMM_DTYPES)}."
        )
    return name


class Reduction(enum.StrEnum):
    """How gradients are combined across shards (TF's `losses.Reduction.SUM`/`MEAN`)."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, value: Reduction | str, *, key: str = "reduction") -> Reduction:
        """Returns the `Reduction` for `value` ("sum"/"mean" in any case, or a member).

        Args:
          value: a member, or its value in any case (surrounding spaces ignored).
          key: what `value` is called where it was given, for the error message.

        Returns:
          The member.

        Raises:
          ValueError: naming `key`, the bad value and the allowed values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(
            f"Unsupported {key}: {value!r}. Allowed: {allowed} "
            "(any case) or xshard.Reduction.SUM / xshard.Reduction.MEAN."
        )
