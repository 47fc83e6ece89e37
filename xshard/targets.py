"""Resolution of ``_target_`` dotted paths from config, restricted to an allowlist.

A config can name any callable by its dotted path (``_target_: optax.adamw``). Importing and
calling arbitrary paths from a config that may come from a sweep file or a CLI override is a
code-execution hazard, so every target goes through `resolve_target`, which refuses paths
outside the allowed prefixes. Projects add their own with the config key ``allowed_targets``.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from xshard.errors import ConfigError

#: Prefixes every config may use; `allowed_targets` in the config adds to these.
DEFAULT_ALLOWED_TARGETS: tuple[str, ...] = ("optax.", "xshard.", "trainers.")

#: Config key that lists additional allowed prefixes or exact paths.
ALLOWED_TARGETS_KEY = "allowed_targets"


def allowed_prefixes(extra: Iterable[str] | None = None) -> tuple[str, ...]:
    """Returns the default allowed prefixes followed by `extra` (from ``allowed_targets``).

    Raises:
      ConfigError: if `extra` is not a list of non-empty strings.
    """
    if extra is None:
        return DEFAULT_ALLOWED_TARGETS
    if isinstance(extra, str) or not all(isinstance(p, str) and p.strip(".") for p in extra):
        raise ConfigError(
            f"{ALLOWED_TARGETS_KEY}={extra!r}: expected a list of module prefixes or dotted "
            "paths, e.g. [mypkg., other.module.my_optimizer]."
        )
    return DEFAULT_ALLOWED_TARGETS + tuple(extra)


def is_allowed(path: str, prefixes: Sequence[str]) -> bool:
    """True if `path` equals an allowed entry or lies inside one (``mypkg`` allows ``mypkg.x``)."""
    for prefix in prefixes:
        base = prefix.rstrip(".")
        if path == base or path.startswith(base + "."):
            return True
    return False


def _locate(path: str) -> Any:
    """Imports the longest importable module prefix of `path`, then walks the attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this very module does not exist" means: try a shorter prefix.
            if e.name is not None and (module_name + ".").startswith(e.name + "."):
                continue
            raise
        for depth, attr in enumerate(parts[i:], start=i):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                owner = ".".join(parts[:depth])
                close = difflib.get_close_matches(
                    attr, [n for n in dir(obj) if not n.startswith("_")]
                )
                hint = (
                    f" Did you mean {', '.join(repr(f'{owner}.{c}') for c in close)}?"
                    if close
                    else ""
                )
                raise LookupError(f"{owner!r} has no attribute {attr!r}.{hint}") from None
        return obj
    raise LookupError(f"no module named {parts[0]!r}.")


def resolve_target(
    path: str,
    allowed: Sequence[str] = DEFAULT_ALLOWED_TARGETS,
    *,
    key: str = "_target_",
) -> Callable[..., Any]:
    """Returns the callable named by the dotted `path`, if the allowlist permits it.

    Args:
      path: a dotted path such as ``"optax.adamw"`` or ``"xshard.schedules.warmup_cosine"``.
      allowed: allowed module prefixes (``"optax."``) or exact paths; see `allowed_prefixes`.
      key: the config key `path` came from, for error messages (``"optimizer._target_"``).

    Returns:
      The imported callable.

    Raises:
      ConfigError: naming `key` and `path`, if the path is empty, not allowed (with how to
        allow it), cannot be imported (with close matches), or is not callable.
    """
    if not isinstance(path, str) or not path.strip() or path.startswith("."):
        raise ConfigError(f"{key}={path!r}: expected a dotted path such as 'optax.adamw'.")
    if not is_allowed(path, allowed):
        module = path.rsplit(".", 1)[0] if "." in path else path
        raise ConfigError(
            f"{key}={path!r} is not an allowed target. Allowed prefixes: {list(allowed)}. "
            f"To allow it, list its module in the config key {ALLOWED_TARGETS_KEY!r}, e.g. "
            f"'{ALLOWED_TARGETS_KEY}: [{module}.]' in your config or "
            f"'+{ALLOWED_TARGETS_KEY}=[{module}.]' on the command line."
        )
    try:
        obj = _locate(path)
    except ImportError as e:
        raise ConfigError(f"{key}={path!r} cannot be imported: {e}") from e
    except LookupError as e:
        raise ConfigError(f"{key}={path!r} was not found: {e}") from e
    if not callable(obj):
        raise ConfigError(f"{key}={path!r} is a {type(obj).__name__}, not a callable.")
    return obj
