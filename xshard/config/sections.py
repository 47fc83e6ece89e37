"""Reading plain values out of config nodes, with errors that name the key.

Shared by the config-driven builders (`xshard.optim.factory`). Each helper raises `ConfigError` with
the config key, the bad value and what is allowed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from xshard.errors import ConfigError


def as_config(cfg: Any) -> DictConfig:
    """Returns `cfg` as a ``DictConfig`` (a plain mapping is wrapped, not copied deeply)."""
    if isinstance(cfg, DictConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return OmegaConf.create(dict(cfg))
    raise ConfigError(
        f"Expected a config node (DictConfig or mapping), got a {type(cfg).__name__}."
    )


def section(cfg: DictConfig, key: str, *, required: bool) -> Any:
    """Returns ``cfg[key]`` as plain Python (dicts, lists, scalars), interpolations resolved.

    Only this node is resolved, so interpolations elsewhere (``${hydra:...}`` outside a Hydra
    app) do not matter.
    """
    try:
        node = OmegaConf.select(cfg, key, default=None, throw_on_missing=True)
        if isinstance(node, DictConfig | ListConfig):
            node = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key or key} is required but missing ('???').") from e
    except InterpolationResolutionError as e:
        reason = str(e.msg).splitlines()[0]
        raise ConfigError(f"{getattr(e, 'full_key', None) or key}: {reason}") from e
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: {e}") from e
    if node is None and required:
        raise ConfigError(f"{key} is required: the config has no '{key}' node (or it is null).")
    return node


def mapping(value: Any, key: str) -> dict[str, Any]:
    """Returns a shallow copy of `value`, which must be a mapping (the node at `key`)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: expected a mapping (a config node).")
    return dict(value)


def check_kwargs(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    prefix: str,
    target: str,
    *,
    supplied: Collection[str] = (),
    other_keys: Sequence[str] = ("_target_",),
) -> None:
    """Checks the config keys `kwargs` against the signature of the target `fn`.

    Args:
      fn: the callable the config names.
      kwargs: the config keys that become its keyword arguments.
      prefix: the config node (``"optimizer"``), for error messages.
      target: its ``_target_``, for error messages.
      supplied: arguments the builder passes itself (the learning rate).
      other_keys: keys of the node that are not arguments, listed as allowed in messages.

    Raises:
      ConfigError: for a key that is not an argument of `fn` (listing the allowed keys), or a
        required argument that is missing.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    named = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and n not in supplied
    ]
    for key in kwargs:
        if key not in named:
            raise ConfigError(
                f"{prefix}.{key}: not an argument of {target}. "
                f"Allowed keys: {[*other_keys, *named]}."
            )
    for n in named:
        if params[n].default is inspect.Parameter.empty and n not in kwargs:
            raise ConfigError(f"{prefix}.{n} is required by {target}.")
