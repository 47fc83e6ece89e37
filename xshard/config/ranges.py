"""What a numeric or dtype config value may be: `Range`, `FloatDtype` and `MAX_STEPS`.

A rule is written once, as a value of a name-keyed table (`xshard.config.optimizers`'s
``OPTIMIZER_RULES``, `xshard.config.schedule_schemas`'s ``SCHEDULE_RULES``), and read from there by
the schemas, the config-driven builders (whatever the node's ``_target_``) and the library's
own functions. Each check raises one `ConfigError` naming the key, the value and what is
allowed. JAX-free, like every schema.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: The largest step count, and the largest integer argument: the step counters (the trainer's
#: ``TrainState.step``, optax's ``count``) are int32, so a step, a period or a count of steps
#: past it would wrap around.
MAX_STEPS = 2**31 - 1
#: How `MAX_STEPS` reads in a message.
MAX_STEPS_SHOWN = f"{MAX_STEPS} (2**31 - 1, an int32)"


@dataclass(frozen=True)
class Range:
    """What a number may be: finite (not a bool), from `low` (inclusive unless `low_open`) up
    to `high` (exclusive unless `high_closed`; None: no bound); null too if `nullable`. An
    `integer` range has `MAX_STEPS` as its bound when `high` is None (every integer argument
    here counts steps or sizes that end up in an int32). A float argument enters the compiled
    programs as an input (`xshard.config.program_inputs`) unless `structural` says why it sets
    the program's structure (the factory branches on it in Python): then it stays a constant."""

    what: str
    low: float = 0.0
    high: float | None = None
    low_open: bool = False
    high_closed: bool = False
    nullable: bool = False
    integer: bool = False
    structural: str = ""

    @property
    def top(self) -> float | None:
        """The upper bound actually applied (`MAX_STEPS`, inclusive, for an unbounded integer)."""
        return MAX_STEPS if self.integer and self.high is None else self.high

    def allows(self, value: Any) -> bool:
        """Whether `value` is allowed."""
        if value is None:
            return self.nullable
        if isinstance(value, bool) or not isinstance(value, int if self.integer else int | float):
            return False
        top, closed = self.top, self.high_closed or (self.integer and self.high is None)
        return (
            math.isfinite(value)
            and (value > self.low if self.low_open else value >= self.low)
            and (top is None or (value <= top if closed else value < top))
        )

    def check(self, value: Any, key: str) -> None:
        """Raises `ConfigError` naming `key` and `value` if `value` is not allowed."""
        if self.allows(value):
            return
        kind = "an integer" if self.integer else "a finite number"
        low = f"{self.low:g} {'<' if self.low_open else '<='}"
        name = key.rsplit(".", 1)[-1]
        if self.integer and self.high is None:
            allowed = f"{kind} with {low} {name} <= {MAX_STEPS_SHOWN}"
        elif self.high is None:
            allowed = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        else:
            high = f"{'<=' if self.high_closed else '<'} {self.high:g}"
            allowed = f"{kind} with {low} {name} {high}"
        null = ", or null for none" if self.nullable else ""
        raise ConfigError(f"{key}={shown(value)}: expected {self.what}, {allowed}{null}.")


#: Floating dtypes a state or an accumulator may be kept in (an integer one would truncate
#: every update to zero); `xshard.config.reduction.COMM_DTYPES` is the same list.
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class FloatDtype:
    """A dtype argument: the name of one of `FLOAT_DTYPES`; null too if `nullable`."""

    what: str
    nullable: bool = True

    def allows(self, value: Any) -> bool:
        """Whether `value` is allowed."""
        return (value is None and self.nullable) or (
            isinstance(value, str) and value in FLOAT_DTYPES
        )

    def check(self, value: Any, key: str) -> None:
        """Raises `ConfigError` naming `key` and `value` if `value` is not allowed."""
        if not self.allows(value):
            null = ", or null for the parameters' dtype" if self.nullable else ""
            raise ConfigError(
                f"{key}={shown(value)}: expected {self.what}, one of {list(FLOAT_DTYPES)}{null}."
            )


@dataclass(frozen=True)
class OneOf:
    """A string argument that names one of `values` (optax.contrib.muon's ``preconditioning``)."""

    what: str
    values: tuple[str, ...]

    def allows(self, value: Any) -> bool:
        """Whether `value` is allowed."""
        return isinstance(value, str) and value in self.values

    def check(self, value: Any, key: str) -> None:
        """Raises `ConfigError` naming `key` and `value` if `value` is not allowed."""
        if not self.allows(value):
            raise ConfigError(
                f"{key}={shown(value)}: expected {self.what}, one of {list(self.values)}."
            )


#: A rule of a name-keyed table.
Rule = Range | FloatDtype | OneOf


def check_args(rules: Mapping[str, Rule], args: Any, prefix: str) -> None:
    """Checks each argument of the mapping `args` that `rules` has a rule for, as
    ``<prefix>.<name>`` (``optimizer.b1``).

    Raises:
      ConfigError: naming the first bad key, its value and what is allowed.
    """
    for name, value in args.items():
        rule = rules.get(name)
        if rule is not None:
            rule.check(value, f"{prefix}.{name}" if prefix else name)
