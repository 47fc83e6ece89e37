"""Resolution of ``_target_`` dotted paths from config, restricted to an allowlist.

A config can name a callable by its dotted path (``_target_: optax.adamw``). Importing and
calling arbitrary paths from a config that may come from a sweep file or a CLI override is a
code-execution hazard, so every target goes through `resolve_target`. A path resolves only if:

1. it is a dotted path of public names (no segment starts with ``_``: no ``__globals__``,
   ``__builtins__``, ``_src``) and lies inside an allowed entry (see `is_allowed`);
2. every module it walks through is itself allowed: each step ``<module>.<name>`` is checked
   with the module's own ``__name__``, so ``trainers.app.preflight.os.system`` stops at ``os``.
   Only prefixes of the path are imported, so nothing outside the allowlist is imported;
3. it ends at a Python class or function (or a ``functools.partial`` of one) defined at the
   top level of a module inside the allowlist: its own ``__module__`` + ``__qualname__`` is
   allowed and names that very object. Modules, builtins, methods, instances are refused.

The defaults are the modules meant to be configured; projects add their own with the config
key ``allowed_targets`` (who may set it is decided by the trainer, `trainers.app.allowlist`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from xshard.errors import ConfigError

#: Entries every config may use; `allowed_targets` in the config adds to these. optax's public
#: API (optimizers, schedules), xshard's schedules, its Muon (optax's, gathering each matrix
#: once under a sharded state: `xshard.optim.muon`) and the trainer's tasks.
DEFAULT_ALLOWED_TARGETS: tuple[str, ...] = (
    "optax.",
    "xshard.schedules.",
    "xshard.optim.muon.muon",
    "trainers.tasks.",
)

#: Config key that lists additional allowed prefixes or exact paths.
ALLOWED_TARGETS_KEY = "allowed_targets"


def _is_dotted_name(text: str, *, trailing_dot: bool = False) -> bool:
    if trailing_dot and text.endswith("."):
        text = text[:-1]
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def allowed_prefixes(extra: Iterable[str] | None = None) -> tuple[str, ...]:
    """Returns the default allowed entries followed by `extra` (from ``allowed_targets``).

    Args:
      extra: the config's ``allowed_targets``: module prefixes (``mypkg.``) or exact dotted
        paths (``mypkg.opt.my_sgd``); None for none.

    Returns:
      `DEFAULT_ALLOWED_TARGETS` plus `extra`, in order.

    Raises:
      ConfigError: if `extra` is not a list of dotted names.
    """
    if extra is None:
        return DEFAULT_ALLOWED_TARGETS
    if isinstance(extra, str) or not all(
        isinstance(p, str) and _is_dotted_name(p, trailing_dot=True) for p in extra
    ):
        raise ConfigError(
            f"{ALLOWED_TARGETS_KEY}={extra!r}: expected a list of module prefixes or dotted "
            "paths, e.g. [mypkg., other.module.my_optimizer]."
        )
    return DEFAULT_ALLOWED_TARGETS + tuple(extra)


def is_allowed(path: str, prefixes: Sequence[str]) -> bool:
    """True if `path` equals an allowed entry or lies inside one (``mypkg`` allows ``mypkg.x``).

    Args:
      path: a dotted name.
      prefixes: allowed entries, with or without a trailing dot.

    Returns:
      Whether `path` is inside the allowlist (the name only; `resolve_target` checks more).
    """
    for prefix in prefixes:
        base = prefix.rstrip(".")
        if path == base or path.startswith(base + "."):
            return True
    return False


def _is_ancestor(name: str, prefixes: Sequence[str]) -> bool:
    """True if `name` is a package above an allowed entry (``xshard`` above
    ``xshard.schedules.``)."""
    return any(prefix.rstrip(".").startswith(name + ".") for prefix in prefixes)


class _Refused(Exception):
    """Internal: the path is refused for the reason in the message."""


def _import(name: str) -> Any:
    """Imports module `name`; None if that very module does not exist."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only "this very module does not exist" means: not a module. Anything else is a
        # broken (allowed) module, reported as such.
        if e.name is not None and (name + ".").startswith(e.name + "."):
            return None
        raise


def _walk(path: str, allowed: Sequence[str]) -> Any:
    """Follows `path` from its first segment through allowed modules only.

    Each step ``<module>.<attr>`` uses the module's own name, which must be allowed or lie above
    an allowed entry; a missing attribute is tried as a submodule of that (allowed) name.
    """
    parts = path.split(".")
    obj = _import(parts[0])
    if obj is None:
        raise LookupError(f"no module named {parts[0]!r}.")
    for depth, attr in enumerate(parts[1:], start=1):
        reached = ".".join(parts[:depth])
        if not inspect.ismodule(obj):
            kind = "class" if inspect.isclass(obj) else type(obj).__name__
            raise _Refused(
                f"{reached!r} is a {kind}, not a module; a target is a class or function "
                "defined at the top level of a module"
            )
        name = f"{obj.__name__}.{attr}"
        if not (is_allowed(name, allowed) or _is_ancestor(name, allowed)):
            raise _Refused(
                f"{reached!r} is the module {obj.__name__!r}, outside the allowed prefixes "
                f"{list(allowed)}; name a target by the module that defines it (and list that "
                f"module in {ALLOWED_TARGETS_KEY!r} if you trust it)"
            )
        try:
            obj = getattr(obj, attr)
            continue
        except AttributeError:
            pass
        sub = _import(name)
        if sub is None:
            close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("_")])
            hint = f" Did you mean {', '.join(repr(f'{reached}.{c}') for c in close)}?"
            raise LookupError(f"{reached!r} has no attribute {attr!r}.{hint if close else ''}")
        obj = sub
    return obj


def _check_defined_in_allowlist(obj: Any, allowed: Sequence[str]) -> None:
    """Refuses anything but a top-level class or function defined under `allowed`."""
    if inspect.ismodule(obj):
        raise _Refused("it is a module; name one of its classes or functions")
    func = obj
    while isinstance(func, functools.partial):  # optax.nadamw = partial(optax.adamw, ...)
        func = func.func
    if not (inspect.isclass(func) or inspect.isfunction(func)):
        raise _Refused(
            f"it is a {type(func).__name__}; a target must be a Python class or function"
        )
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise _Refused("it does not say which module defines it")
    canonical = f"{module}.{qualname}"
    if "." in qualname or "<" in qualname:
        raise _Refused(f"it is {canonical!r}, not defined at the top level of a module")
    if not is_allowed(canonical, allowed):
        raise _Refused(
            f"it is {canonical!r}, defined outside the allowed prefixes {list(allowed)}; a "
            f"target must be defined in an allowed module. To allow it, list the module that "
            f"defines it in {ALLOWED_TARGETS_KEY!r}"
        )
    home = sys.modules.get(module)
    if home is None or vars(home).get(qualname) is not func:
        raise _Refused(f"it claims to be {canonical!r}, but that name holds another object")


def resolve_target(
    path: str,
    allowed: Sequence[str] = DEFAULT_ALLOWED_TARGETS,
    *,
    key: str = "_target_",
) -> Callable[..., Any]:
    """Returns the class or function named by the dotted `path`, if the allowlist permits it.

    Args:
      path: a dotted path such as ``"optax.adamw"`` or ``"xshard.schedules.warmup_cosine"``.
      allowed: allowed module prefixes (``"optax."``) or exact paths; see `allowed_prefixes`.
      key: the config key `path` came from, for error messages (``"optimizer._target_"``).

    Returns:
      The class or function (module docstring: the rules it satisfies).

    Raises:
      ConfigError: naming `key` and `path`, if the path is empty or not a dotted path of
        public names, not allowed (with how to allow it), reaches outside the allowlist, is
        not a class or function defined in an allowed module, or cannot be imported or found
        (with close matches).
    """
    if not isinstance(path, str) or not _is_dotted_name(path):
        raise ConfigError(f"{key}={path!r}: expected a dotted path such as 'optax.adamw'.")
    private = [part for part in path.split(".") if part.startswith("_")]
    if private:
        raise ConfigError(
            f"{key}={path!r} is not an allowed target: {private[0]!r} is a private name; a "
            "target is a public class or function, e.g. 'optax.adamw'."
        )
    if not is_allowed(path, allowed):
        module = path.rsplit(".", 1)[0] if "." in path else path
        raise ConfigError(
            f"{key}={path!r} is not an allowed target. Allowed prefixes: {list(allowed)}. "
            f"To allow it, list its module in the config key {ALLOWED_TARGETS_KEY!r}, e.g. "
            f"'{ALLOWED_TARGETS_KEY}: [{module}.]' in your primary config or "
            f"'+{ALLOWED_TARGETS_KEY}=[{module}.]' on the command line."
        )
    try:
        obj = _walk(path, allowed)
        _check_defined_in_allowlist(obj, allowed)
    except _Refused as e:
        raise ConfigError(f"{key}={path!r} is not an allowed target: {e}.") from None
    except ImportError as e:
        raise ConfigError(f"{key}={path!r} cannot be imported: {e}") from e
    except LookupError as e:
        raise ConfigError(f"{key}={path!r} was not found: {e}") from e
    return obj


#: Config key of a node that is built into a `functools.partial` instead of being called.
PARTIAL_KEY = "_partial_"


def check_nested_targets(value: Any, key: str, allowed: Sequence[str]) -> None:
    """Checks every ``_target_`` in `value` (a node and all nodes below it) by name only.

    Nothing is imported: a target outside the allowlist, or with a private segment, is
    refused before any module of the tree is imported.

    Args:
      value: plain config values (dicts, lists, scalars).
      key: the config key of `value`, for error messages (``task``).
      allowed: the allowed entries (`allowed_prefixes`).

    Raises:
      ConfigError: naming the nested key (``task.model._target_``) of the first target that
        is not a dotted path of public names inside the allowlist.
    """
    if isinstance(value, Mapping):
        if "_target_" in value:
            target = value["_target_"]
            where = f"{key}._target_"
            if not isinstance(target, str) or not _is_dotted_name(target):
                raise ConfigError(
                    f"{where}={target!r}: expected a dotted path such as 'optax.adamw'."
                )
            if any(p.startswith("_") for p in target.split(".")) or not is_allowed(target, allowed):
                resolve_target(target, allowed, key=where)  # raises, with the usual message
        for k, v in value.items():
            if k != "_target_":
                check_nested_targets(v, f"{key}.{k}", allowed)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_nested_targets(v, f"{key}[{i}]", allowed)


def instantiate_nested(
    node: Mapping[str, Any],
    key: str,
    allowed: Sequence[str],
    *,
    factory_args: Sequence[str] | None = None,
) -> Any:
    """Like `instantiate`, but nested ``_target_`` nodes are built too, bottom-up (Hydra's way).

    Every ``_target_`` of the tree is first checked against the allowlist by name
    (`check_nested_targets`), so nothing is imported when one of them is not allowed. Then
    each nested node is resolved and called with its own (already built) keys. A node with
    ``_partial_: true`` becomes a `functools.partial` instead, to be called later by what
    receives it; so does the node of each argument the target names in its class attribute
    ``factory_args`` (e.g. a Flax NNX task's ``model``, which the task builds with the run's
    RNG), unless `factory_args` overrides that list.

    Args:
      node: the node as plain Python (``_target_`` plus keyword arguments).
      key: the node's config key (``task``), for error messages.
      allowed: the allowed entries (`allowed_prefixes`).
      factory_args: arguments of the top node whose nodes are passed as partials; None: the
        target's ``factory_args`` attribute (none if it has no such attribute).

    Returns:
      What the top node's target returned.

    Raises:
      ConfigError: for a not allowed, unknown or missing target anywhere in the tree (naming
        its key, e.g. ``task.model._target_``), a key that is not an argument of its target,
        or a value a target rejects.
    """
    check_nested_targets(node, key, allowed)
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"{key}._target_ is required: the dotted path of what to build.")
    factory = resolve_target(target, allowed, key=f"{key}._target_")
    if factory_args is None:
        factory_args = tuple(getattr(factory, "factory_args", ()))
    built = {
        k: _build(v, f"{key}.{k}", allowed, partial=k in factory_args)
        for k, v in node.items()
        if k not in ("_target_", PARTIAL_KEY)
    }
    return _call(factory, target, built, key, partial=bool(node.get(PARTIAL_KEY, False)))


def _build(value: Any, key: str, allowed: Sequence[str], *, partial: bool = False) -> Any:
    """A nested config value with its ``_target_`` nodes built (checked by the caller)."""
    if isinstance(value, list | tuple):
        return [_build(v, f"{key}[{i}]", allowed) for i, v in enumerate(value)]
    if not isinstance(value, Mapping):
        return value
    if "_target_" not in value:
        return {k: _build(v, f"{key}.{k}", allowed) for k, v in value.items()}
    target = value["_target_"]
    factory = resolve_target(target, allowed, key=f"{key}._target_")
    kwargs = {
        k: _build(v, f"{key}.{k}", allowed)
        for k, v in value.items()
        if k not in ("_target_", PARTIAL_KEY)
    }
    return _call(factory, target, kwargs, key, partial=partial or bool(value.get(PARTIAL_KEY)))


def _call(factory: Callable, target: str, kwargs: dict, key: str, *, partial: bool) -> Any:
    """``factory(**kwargs)``, or its partial; keys checked against its signature."""
    from xshard.config.sections import check_kwargs

    if partial:
        unknown = _unknown_kwargs(factory, kwargs)
        if unknown:
            check_kwargs(factory, {unknown[0]: None}, key, target)  # raises, naming it
        return functools.partial(factory, **kwargs)
    check_kwargs(factory, kwargs, key, target)
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({target}): {e}") from e


def _unknown_kwargs(fn: Callable, kwargs: Mapping[str, Any]) -> list[str]:
    """The keys of `kwargs` that `fn` does not take (none if it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    named = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return [k for k in kwargs if k not in named]


def instantiate(node: Mapping[str, Any], key: str, allowed: Sequence[str]) -> Any:
    """Calls the ``_target_`` of a config node with the node's other keys, if it is allowed.

    The other keys are passed as plain values: nested ``_target_`` nodes are not
    instantiated, so a config cannot make the run call anything but the allowed target
    (`instantiate_nested` builds them, each under the allowlist).

    Args:
      node: the node as plain Python (``_target_`` plus keyword arguments).
      key: the node's config key (``task``, ``trainer.hooks[0]``), for error messages.
      allowed: the allowed entries (`allowed_prefixes`).

    Returns:
      What the target returned.

    Raises:
      ConfigError: for a missing, not allowed or unknown target, a key that is not an
        argument of it, or a value it rejects (TypeError or ValueError).
    """
    from xshard.config.sections import check_kwargs

    kwargs = dict(node)
    target = kwargs.pop("_target_", None)
    if target is None:
        raise ConfigError(f"{key}._target_ is required: the dotted path of what to build.")
    factory = resolve_target(target, allowed, key=f"{key}._target_")
    check_kwargs(factory, kwargs, key, target)
    try:
        return factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({target}): {e}") from e
