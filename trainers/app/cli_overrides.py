"""Command-line overrides that Hydra refuses with a traceback, refused in one line instead.

Hydra composes the config before any of xshard's code runs. A config group given a value that
is not the name of an option (``schedule=null``, ``optimizer=1``) stops that composition with
a ``ValueError`` and a 25-line traceback (exit 1). `check_group_overrides` reads the command
line first, so such an override is one line naming the group, the value and the group's
options, with exit status 2, as every other bad value (`trainers.train`'s docstring). An
override of a key that was removed (`trainers.config.run.REMOVED_KEYS`), which Hydra would
refuse as "not in struct", is one line too, saying that it was removed and why. So is a key
(or a group's option) too long to be a file name: Hydra looks each key up as a config group (a
folder) or option (a ``.yaml`` file), and the file system's "File name too long" was a
traceback (`long_name_error`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from trainers.config.cli_args import override_key
from xshard.config.nodes import one_line
from xshard.errors import ConfigError

#: The config module of ``python -m trainers.train`` and ``trainers.doctor``.
CONFIG_MODULE = "xshard.conf"


def group_override_error(
    overrides: Sequence[str], config_module: str = CONFIG_MODULE
) -> ConfigError | None:
    """The error for the first override that gives a config group no option name, if any.

    Args:
      overrides: the command line's overrides (other arguments are skipped: flags, and
        whatever Hydra's parser refuses, which Hydra reports itself).
      config_module: the package of the primary config, whose groups are looked up.

    Returns:
      A `ConfigError` naming the group, the value as typed and the group's options, or None.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    suspects = []
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        key = override.key_or_group
        if override.is_delete() or "." in key:
            continue  # a deletion takes null; a key with a dot is never a group
        values = _values(override)
        bad = next((v for v in values if not _may_name_an_option(v)), _NONE)
        if bad is not _NONE:
            suspects.append((key, bad))
    if not suspects:
        return None
    with _config_loader(config_module) as loader:
        for key, bad in suspects:
            parent, _, name = key.rpartition("/")
            if name not in loader.list_groups(parent):
                continue  # a plain key (seed=5)
            options = sorted(loader.get_group_options(key))
            return ConfigError(
                f"{key}={one_line(_as_typed(bad))}: expected the name of an option of the {key!r} "
                f"group, one of {options}."
            )
    return None


def check_group_overrides(argv: Sequence[str] | None = None) -> None:
    """Exits with status 2 and one line on stderr if an override gives a config group a value
    that is not an option name (`group_override_error`), sets a removed key
    (`removed_key_error`) or a key too long to be one (`long_name_error`); returns otherwise.

    Args:
      argv: the command line's arguments; None: ``sys.argv[1:]``.
    """
    from trainers.exits import EXIT_CONFIG_ERROR

    args = sys.argv[1:] if argv is None else argv
    error = long_name_error(args) or removed_key_error(args) or group_override_error(args)
    if error is not None:
        print(f"xshard: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def removed_key_error(overrides: Sequence[str]) -> ConfigError | None:
    """The error for the first override that sets a removed key, if any.

    Args:
      overrides: the command line's arguments (``trainer.step_executables=one``, with or
        without ``+``/``++``; flags and deletions are skipped).

    Returns:
      A `ConfigError` naming the key, saying that it was removed and why
      (`trainers.config.run.REMOVED_KEYS`), or None.
    """
    from trainers.config.run import REMOVED_KEYS

    for arg in overrides:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key, value = override_key(arg), arg.partition("=")[2]
        if key in REMOVED_KEYS:
            return ConfigError(f"{key}={value}: this key was removed: {REMOVED_KEYS[key]}")
    return None


def long_name_error(overrides: Sequence[str]) -> ConfigError | None:
    """The error for the first override whose key has a part (between ``/``) longer than a
    config file's name can be, if any: no config key or group is (Hydra looks the key up as a
    group folder and an option file, ``<key>.yaml``).

    Args:
      overrides: the command line's arguments (flags are skipped).

    Returns:
      A `ConfigError` naming the key (elided), its length and the longest allowed, or None.
    """
    from trainers.config.resolvers import NAME_MAX

    longest = NAME_MAX - len(".yaml")
    for arg in overrides:
        if arg.startswith("-"):
            continue
        key, value = override_key(arg), arg.partition("=")[2]
        size = max(len(part.encode()) for part in key.split("/"))
        if size > longest:
            return ConfigError(
                f"{one_line(key)}={one_line(value)}: a key of {size} bytes; no config key or group "
                f"is longer than {longest} bytes (Hydra looks each one up as a file, and a file "
                f"name has at most {NAME_MAX}). Check the override's key."
            )
    return None


_NONE = object()


def _values(override: Any) -> list[Any]:
    """The override's value, or each value of a choice sweep (``schedule=null,cosine``)."""
    from hydra.errors import HydraException

    if not override.is_sweep_override():
        return [override.value()]
    try:
        return list(override.sweep_iterator())
    except HydraException:  # interval() and glob(): no values of their own; Hydra judges them
        return []


def _may_name_an_option(value: Any) -> bool:
    """Whether `value` could name an option of a group: a string short enough to be a file's
    name (an option is ``<name>.yaml``), or a list or mapping, which Hydra judges itself."""
    from trainers.config.resolvers import NAME_MAX

    if isinstance(value, str):
        return len(value.encode()) <= NAME_MAX - len(".yaml")
    return isinstance(value, list | dict)


def _as_typed(value: Any) -> str:
    """`value` as written on the command line: ``null``, ``true``, ``1``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@contextlib.contextmanager
def _config_loader(config_module: str) -> Iterator[Any]:
    """Hydra's config loader: the running app's if Hydra is initialised, else one for
    `config_module` for the duration of the ``with`` block."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield GlobalHydra.instance().config_loader()
        return
    with initialize_config_module(config_module, version_base="1.3"):
        yield GlobalHydra.instance().config_loader()
