"""`Reduction`, the mode of a reduction across shards, in a module without JAX.

The mode has one rule (`Reduction.parse`) for both of its ways in: the library's
``xshard.cross_shard(inner, "mean")`` and the config's ``reduction.mode``, whose schema
(`xshard.config.schemas.ReductionConf`) must stay importable without JAX (Hydra's plugin scan
imports it). The schema parses the config's string once; what it hands on is a `Reduction`.
"""

from __future__ import annotations

import enum


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
