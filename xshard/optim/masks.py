"""Masks, named in config (``optimizer.weight_decay_mask: no_bias_no_norm``).

A mask is a function ``params -> pytree of bools`` (True: decay this parameter), the form
optax's ``mask=`` / ``weight_decay_mask=`` arguments take. ``optimizer.muon_mask`` names a rule
of `xshard.optim.muon_masks` instead (``params -> pytree of MuonDimensionNumbers or None``),
resolved the same way (`MASK_KINDS`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from xshard.config.targets import DEFAULT_ALLOWED_TARGETS, resolve_target
from xshard.errors import ConfigError
from xshard.optim.muon_masks import MUON_MASKS
from xshard.stats.tree import path_names

Mask = Callable[[Any], Any]

#: Path components that mark a parameter as a bias or a normalisation scale/offset.
_NO_DECAY = re.compile(r"bias|scale|norm", re.IGNORECASE)


def no_bias_no_norm(params: Any) -> Any:
    """Decays matrices only: False for 0-/1-D params and for paths naming bias/scale/norm.

    Args:
      params: a parameter pytree (arrays or shape-dtype structs).

    Returns:
      A pytree of bools shaped like `params`.
    """

    def decay(path: tuple[Any, ...], x: Any) -> bool:
        if getattr(x, "ndim", 0) < 2:
            return False
        return not any(_NO_DECAY.search(name) for name in path_names(path))

    return jax.tree_util.tree_map_with_path(decay, params)


#: Masks by config name. ``null`` in config means: no mask, decay every parameter.
MASKS: dict[str, Mask] = {"no_bias_no_norm": no_bias_no_norm}


class MaskKind(NamedTuple):
    """What a mask key takes: its named functions, what null means, what a function returns."""

    names: Mapping[str, Mask]
    null: str
    returns: str


#: Each mask key of the ``optimizer`` node (`xshard.optim.factory.MASK_ARGS`), by its last part.
MASK_KINDS: dict[str, MaskKind] = {
    "weight_decay_mask": MaskKind(MASKS, "decay every parameter", "pytree of bools"),
    "trust_ratio_mask": MaskKind(MASKS, "a trust ratio for every parameter", "pytree of bools"),
    "muon_mask": MaskKind(
        MUON_MASKS,
        "optax's default: Muon for every 2-D parameter",
        "pytree of optax.contrib.MuonDimensionNumbers() (Muon) or None (Adam)",
    ),
}


def resolve_mask(value: str, allowed: Sequence[str] = DEFAULT_ALLOWED_TARGETS, *, key: str) -> Mask:
    """Returns the mask function for a config value: a name its key allows or a dotted path.

    Args:
      value: a name of the key's `MaskKind` (``"no_bias_no_norm"``; ``"hidden_matrices"``
        for ``muon_mask``), or the dotted path of a function ``params -> pytree`` (subject to
        the ``allowed_targets`` allowlist, like every ``_target_``).
      allowed: allowed target prefixes, for dotted paths.
      key: the config key `value` came from (``optimizer.weight_decay_mask``).

    Raises:
      ConfigError: naming `key`, the value and the allowed values.
    """
    kind = MASK_KINDS.get(key.rsplit(".", 1)[-1], MASK_KINDS["weight_decay_mask"])
    if isinstance(value, str) and value in kind.names:
        return kind.names[value]
    if isinstance(value, str) and "." in value:
        return resolve_target(value, allowed, key=key)
    raise ConfigError(
        f"{key}={value!r} is not a known mask. Allowed: {sorted(kind.names)}, null "
        f"({kind.null}), or the dotted path of a function params -> {kind.returns}."
    )
