"""Checks of the built-in tasks' constructor arguments, with messages that name the key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any


def positive_int(value: Any, key: str) -> int:
    """Returns `value` as an int if it is an integer >= 1 (not a bool).

    Raises:
      ValueError: naming `key` (``task.in_dim``) and the value.
    """
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{key}={value!r}: expected an integer >= 1.")
    return int(value)


def positive_ints(values: Any, key: str) -> tuple[int, ...]:
    """Returns `values` as a tuple of ints if it is a list of integers >= 1.

    Raises:
      ValueError: naming `key` (``task.hidden``) and the values.
    """
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"{key}={values!r}: expected a list of integers >= 1.")
    if not all(isinstance(v, Integral) and not isinstance(v, bool) and int(v) >= 1 for v in values):
        raise ValueError(f"{key}={list(values)!r}: expected a list of integers >= 1.")
    return tuple(int(v) for v in values)


def non_negative_number(value: Any, key: str) -> float:
    """Returns `value` as a float if it is a finite number >= 0 (not a bool).

    Raises:
      ValueError: naming `key` (``task.noise_std``) and the value.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{key}={value!r}: expected a finite number >= 0.")
    return float(value)
