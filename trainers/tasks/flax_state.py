"""Helpers of the Flax tasks that need no Flax: nested dicts from paths, the manual data axes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax


def path_key(key: Any) -> str:
    """A path entry as a dict key of the params: a string (``0`` for list index 0).

    String keys are what a checkpoint restores (Orbax writes every key as a string), and what
    the param paths of sharding rules and masks show (``layers/0/kernel``).
    """
    return str(key)


def nested(items: Iterable[tuple[tuple[str, ...], Any]]) -> dict:
    """``{("a", "b"): x}`` pairs as nested dicts ``{"a": {"b": x}}``."""
    out: dict = {}
    for path, value in items:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def manual_axes() -> tuple[str, ...]:
    """The mesh axes the current trace is manual over: the data axes inside the trainer's
    manual step (``trainer.grad_impl=manual``), else ``()``."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)
