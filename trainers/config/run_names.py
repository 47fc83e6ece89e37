"""Short run names: a sweep job's folder and a TensorBoard run named by what differs.

``logger.run_names`` chooses how a run's folders are named (`RUN_NAME_STYLES`):

- ``short`` (the default): each override as the last component of its key and its value,
  a float rounded to 3 significant digits, and in a multirun the job's number first and only
  the keys the sweep varies (`trainers.config.resolvers.sweep_keys`):
  ``3_every_steps=16,learning_rate=0.617`` for
  ``reduction.axes.slice.every_steps=16,reduction.axes.slice.outer_optimizer.learning_rate=
  0.6166052607590903``. Two keys with the same last component keep as many components as
  tell them apart (``optimizer.learning_rate``, ``outer_optimizer.learning_rate``). The job
  number keeps the names of a sweep apart even where rounded values meet;
- ``overrides``: the overrides as typed, joined as in Hydra's ``override_dirname`` (the names
  before this option existed).

Either way the name is one clean path component, cut with a hash past
`trainers.config.resolvers.MAX_NAME` bytes; the full overrides are in TensorBoard's HParams
and the job's ``result.json``.
"""

from __future__ import annotations

import math

from trainers.config.cli_args import override_key
from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: ``logger.run_names`` values.
SHORT, OVERRIDES = "short", "overrides"
RUN_NAME_STYLES = (SHORT, OVERRIDES)
#: Significant digits of a float in a short name.
DIGITS = 3


def check_style(style: object, key: str = "logger.run_names") -> str:
    """Returns `style` if it is one of `RUN_NAME_STYLES`.

    Raises:
      ConfigError: naming `key`, the value and the allowed ones.
    """
    if style not in RUN_NAME_STYLES:
        raise ConfigError(
            f"{key}={shown(style)}: expected one of {list(RUN_NAME_STYLES)} (short: the job "
            "number and each key's last component, values rounded; overrides: as typed)."
        )
    return str(style)


def shown_value(value: str) -> str:
    """`value` for display: a float rounded to `DIGITS` significant digits (``0.617``,
    ``0.0003``, ``1e-05``), anything else as typed (integers, names, lists)."""
    if not any(c in value for c in ".eE") or value.strip().lower() in ("inf", "-inf", "nan"):
        return value
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.{DIGITS}g}" if math.isfinite(number) else value


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key as its shortest suffix of components that no other key of `keys` ends
    with (``learning_rate``; ``optimizer.learning_rate`` beside
    ``outer_optimizer.learning_rate``)."""
    split = {key: key.split(".") for key in keys}
    short = {}
    for key, parts in split.items():
        for n in range(1, len(parts) + 1):
            tail = parts[-n:]
            if not any(o != key and other[-n:] == tail for o, other in split.items()):
                break
        short[key] = ".".join(tail)
    return short


def short_name(overrides: list[str], job_num: int | None = None) -> str:
    """The short name of a run with `overrides` (``key=value``, sorted as given), with
    ``<job_num>_`` first in a multirun (module docstring); ``run`` for none."""
    bare_keys = [override_key(o) for o in overrides]
    keys = short_keys(bare_keys)
    parts = []
    for override, bare in zip(overrides, bare_keys):
        key, eq, value = override.partition("=")  # the value as typed
        # +key=value shows as key=value; a deletion (~key) keeps its sign.
        shown = f"{keys[bare]}={shown_value(value)}" if eq else key[: -len(bare)] + keys[bare]
        parts.append(shown)
    name = ",".join(parts)
    if job_num is None:
        return name or "run"
    return f"{job_num}_{name}" if name else str(job_num)
