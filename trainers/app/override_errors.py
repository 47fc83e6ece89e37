"""A command-line override Hydra cannot apply, in one line with exit status 2.

Hydra applies the overrides to the composed config one by one
(``ConfigLoaderImpl._apply_overrides_to_config``); one that does not fit the schema (a value
of the wrong type, ``optimizer.learning_rate=fast``, ``reduction.skip_nonfinite=maybe``; a
key the node does not have, ``optimizer.lr=0.1``) ends in Hydra's own report of several lines
and exit status 1. While `readable_overrides` is active it ends in one line instead, naming
the override, what the schema expects there and, for an unknown key, the keys the node has
(worded as `xshard.config` words an unknown key), with the exit status of every other bad
value (`trainers.exits.EXIT_CONFIG_ERROR`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError


def _node_keys(cfg: DictConfig, key: str) -> list[str]:
    """The keys of the node that holds `key`, in the node's order."""
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def override_error_line(override: Any, error: BaseException, cfg: DictConfig) -> str:
    """One line for `override` (Hydra's ``Override``) that failed with `error` on `cfg`."""
    line = override.input_line or override.key_or_group
    key = override.key_or_group
    cause = error.__cause__ or error.__context__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and not override.is_add():
        return f"{line}: unknown key. Allowed keys: {_node_keys(cfg, key)}."
    if isinstance(cause, ValidationError):
        owner = getattr(cause.object_type, "__name__", None)
        first = str(cause.msg).splitlines()[0]  # the rest repeats the key and the type
        return f"{line}: {first}, the type of {cause.full_key or key}" + (
            f" in {owner}" if owner else ""
        )
    message = " ".join(str(error).split()) or type(cause or error).__name__
    return f"{line}: {message}"


@contextlib.contextmanager
def readable_overrides(exit_code: int) -> Iterator[None]:
    """While active, an override Hydra cannot apply ends the process with one line on stderr
    (`override_error_line`) and `exit_code`; every other override applies as Hydra applies it.

    Args:
      exit_code: the exit status of a bad override.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    apply = ConfigLoaderImpl._apply_overrides_to_config

    def applied(overrides: list[Any], cfg: DictConfig) -> None:
        for override in overrides:  # one at a time: the error names the one that failed
            try:
                apply([override], cfg)
            except ConfigCompositionException as e:
                print(f"xshard: error: {override_error_line(override, e, cfg)}", file=sys.stderr)
                sys.exit(exit_code)

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(applied)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply)  # type: ignore[method-assign]
