"""`read_node`: a composed config node as a typed dataclass, with one-line errors.

OmegaConf already knows how to check and convert values against a dataclass (a *structured
config*): ``"3"`` becomes 3 for an ``int`` field, ``"maybe"`` is refused for a ``bool``. This
module runs that check after composition, so a bad value reaches the user as a `ConfigError`
(the CLI's exit 2 and one line) rather than as a Hydra composition traceback, and then builds
the dataclass, whose ``__post_init__`` checks ranges and choices.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from xshard.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

#: Longest value repr echoed in an error message; longer ones are elided.
MAX_SHOWN = 120


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, elided in the middle when longer than `limit` characters."""
    return _elide(repr(value), limit)


def _elide(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-limit // 4 :]} ({len(text)} characters)"


def one_line(message: str, limit: int = MAX_SHOWN) -> str:
    """`message` on one line, each word longer than `limit` characters elided (`shown`)."""
    words = " ".join(message.split()).split(" ")
    return " ".join(_elide(w, limit) for w in words)


def read_node(schema: type[T], node: Any, key: str) -> T:
    """Reads the config node at `key` as an instance of the dataclass `schema`.

    Args:
      schema: a dataclass whose fields are the node's keys (types as OmegaConf supports them:
        ``int``, ``float``, ``bool``, ``str``, ``X | None``, lists of those).
      node: the composed node (``DictConfig`` or mapping); interpolations are resolved.
      key: the node's config key (``"trainer"``), for error messages.

    Returns:
      The dataclass instance; its ``__post_init__`` has run.

    Raises:
      ConfigError: for a node that is not a mapping, an unknown key (listing the allowed
        ones), a missing key, or a value of the wrong type; and whatever ``__post_init__``
        raises.
    """
    names = [f.name for f in dataclasses.fields(schema)]
    if OmegaConf.is_config(node):
        try:
            node = OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{key}: {_first_line(e)}") from e
    if not isinstance(node, dict):
        raise ConfigError(f"{key}={shown(node)}: expected a mapping with keys {names}.")
    for name in node:
        if name not in names:
            raise ConfigError(f"{key}.{name}: unknown key. Allowed keys: {names}.")
    for name in names:
        if name not in node and _required(schema, name):
            raise ConfigError(f"{key}.{name} is required but missing.")
    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), node)
    except ValidationError as e:
        raise ConfigError(_bad_value(key, node, str(e.full_key or ""), _type_hint(e))) from e
    except (ConfigKeyError, OmegaConfBaseException) as e:
        raise ConfigError(f"{key}: {_first_line(e)}") from e
    assert isinstance(typed, DictConfig)
    return OmegaConf.to_object(typed)  # type: ignore[return-value]


#: Field metadata marking a key whose value is a place the run writes to or connects to (a
#: directory, a file, a server): `location_keys` lists them for the trust rule, under which only
#: trusted sources may set them (``trainers.app.trust``). Mark new keys of that kind with it:
#: ``dir: str = dataclasses.field(default=..., metadata=LOCATION)``.
LOCATION: dict[str, bool] = {"xshard.location": True}


def location_keys(schema: type, prefix: str) -> tuple[str, ...]:
    """The dotted keys of the fields of `schema` (and of its nested dataclass fields) that are
    marked `LOCATION`, under the node `prefix`."""
    hints = typing.get_type_hints(schema)
    found: list[str] = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}.{f.name}"
        if f.metadata.get("xshard.location"):
            found.append(key)
        for arg in typing.get_args(hints[f.name]) or (hints[f.name],):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                found.extend(location_keys(arg, key))
    return tuple(found)


@functools.cache
def permissive(schema: type) -> type:
    """A copy of the dataclass `schema` with every field typed `Any` (same names, defaults).

    Registered in Hydra's ConfigStore for the nodes that `read_node` checks after composition:
    composition then knows every key and default (a typo still fails, ``trainer.x=1`` without
    ``+``), but leaves the values to `read_node`, whose errors are one line and exit 2. A
    nested dataclass field (``trainer.early_stopping``) gets a permissive copy of its own. (A
    nested node's dataclass is not frozen: ``OmegaConf.merge`` cannot write into a frozen one.)
    """
    fields = []
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            if isinstance(factory, type) and dataclasses.is_dataclass(factory):
                factory = permissive(factory)
            fields.append((f.name, Any, dataclasses.field(default_factory=factory)))
        else:
            fields.append((f.name, Any, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(f"{schema.__name__}Node", fields)


def _required(schema: type, name: str) -> bool:
    field = next(f for f in dataclasses.fields(schema) if f.name == name)
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


_MISSING = object()


def _bad_value(key: str, node: dict[str, Any], full_key: str, hint: str) -> str:
    """``<key>.<field>=<its value>: <hint>``, where `full_key` (OmegaConf's, relative to the
    node) may point inside the field: ``profile_steps[0]`` shows the whole list and says which
    item is wrong; a key inside nested mappings is shown with its own value
    (``reduction.axes.slice.every_steps=3e9``)."""
    field = re.split(r"[.\[]", full_key, maxsplit=1)[0]
    if field not in node:  # not expected: OmegaConf names a key of the node
        return f"{key}.{full_key}: {hint}"
    leaf: Any = node
    for part in full_key.split(".") if "[" not in full_key else []:  # inside nested mappings
        leaf = leaf.get(part, _MISSING) if isinstance(leaf, dict) else _MISSING
    if leaf is not _MISSING and leaf is not node:
        return f"{key}.{full_key}={shown(leaf)}: {hint}"
    inside = f" at {key}.{full_key}" if full_key != field else ""
    return f"{key}.{field}={shown(node[field])}: {hint}{inside}"


def _type_hint(e: ValidationError) -> str:
    """'expected an integer' etc. from OmegaConf's message."""
    msg = _first_line(e)
    for word, hint in (
        ("integer", "expected an integer"),
        ("float", "expected a number"),
        ("bool", "expected true or false"),
        ("string", "expected a string"),
        ("none", "expected a value, not null"),
    ):
        if word in msg.lower():
            return hint
    return msg


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
