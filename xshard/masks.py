"""Weight-decay masks, named in config (``optimizer.weight_decay_mask: no_bias_no_norm``).

A mask is a function ``params -> pytree of bools`` (True: decay this parameter), the form
optax's ``mask=`` / ``weight_decay_mask=`` arguments take.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from xshard.errors import ConfigError
from xshard.stats import path_names
from xshard.targets import DEFAULT_ALLOWED_TARGETS, resolve_target

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


def resolve_mask(value: str, allowed: Sequence[str] = DEFAULT_ALLOWED_TARGETS, *, key: str) -> Mask:
    """Returns the mask function for a config value: a name in `MASKS` or a dotted path.

    Args:
      value: ``"no_bias_no_norm"``, or the dotted path of a function ``params -> bools``
        (subject to the ``allowed_targets`` allowlist, like every ``_target_``).
      allowed: allowed target prefixes, for dotted paths.
      key: the config key `value` came from, for error messages.

    Raises:
      ConfigError: naming `key`, the value and the allowed values.
    """
    if isinstance(value, str) and value in MASKS:
        return MASKS[value]
    if isinstance(value, str) and "." in value:
        return resolve_target(value, allowed, key=key)
    raise ConfigError(
        f"{key}={value!r} is not a known mask. Allowed: {sorted(MASKS)}, null (decay every "
        "parameter), or the dotted path of a function params -> pytree of bools."
    )
