"""The trust rule: what a config file that is not trusted may set, as an allowlist.

Threat model (docs/reliability.md): code a user installs is trusted, and so are the files that
come with it (``pkg://`` and ``structured://`` sources) and the primary config the user names;
what the user types on the command line is theirs; any other config file (``--config-dir``,
``hydra.searchpath``, an experiment or sweep file copied from elsewhere, a copied run dir's
saved config) is not. Such a file may set only:

- values of config keys that trusted sources declare: top-level nodes a trusted file of the
  same composition sets (their keys and types are then checked by the nodes' schemas,
  `xshard.config.read_node`, and a ``_target_``'s arguments by the allowlisted target);
- ``allowed_targets`` entries that a trusted source already grants (`trainers.app.allowlist`);
- a sweep's search space over such keys: ``hydra.sweeper.params`` (each key an override of a
  config key above, each value a plain sweep value), ``hydra.sweeper.direction`` and
  ``hydra.sweeper.n_trials``.

Everything else is refused (`refusals`), among it: every other ``hydra.*`` key (Hydra acts on
them before any task code runs), a ``hydra/*`` group or a ``@hydra...`` package chosen in the
file's defaults list, the keys marked as locations in the schemas (where the run writes or
connects: `trainers.config.trainer_schemas.LOCATION_KEYS`), and resolvers that read outside the
config (``${oc.env:...}`` and every resolver but `SAFE_RESOLVERS`). The widening sources are
those no file can write: the process's arguments, ``XSHARD_ALLOWED_TARGETS`` from the parent
environment and installed entry points. `trainers.app.config_guard` applies this rule inside
every Hydra composition; `trainers.app.run_dir_config` applies it to a run dir's saved config.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from trainers.config.trainer_schemas import LOCATION_KEYS
from xshard.config.nodes import shown
from xshard.config.targets import ALLOWED_TARGETS_KEY

#: The ``hydra`` keys a file that is not trusted may set: a sweep's search space.
SWEEP_PARAMS = "hydra.sweeper.params"
SWEEP_SETTINGS = ("hydra.sweeper.direction", "hydra.sweeper.n_trials")
#: What ``hydra.sweeper.direction`` may be (one objective or several).
DIRECTIONS = ("minimize", "maximize")
#: Keys no config file may set: Hydra records the real overrides there after composing.
FORGED_KEY = "hydra.overrides"
#: Resolvers a file that is not trusted may use: they read the config only.
SAFE_RESOLVERS = ("oc.select",)

#: ``${name:`` of a resolver call anywhere in a string (also escaped or quoted inside another).
_RESOLVER_CALL = re.compile(r"\$\{\s*([^\s:${}'\"\\]+)\s*:")


class Refusal(NamedTuple):
    """One key a file may not set, and why (for the one-line error)."""

    key: str
    why: str


class ComposedFile(NamedTuple):
    """One config file, as written (nothing resolved).

    Attributes:
      name: where it was read from, for messages (a path, or ``pkg://module/name.yaml``).
      trusted: the primary config, or a file of an installed package.
      package: the config node its content lands in ("" for the root).
      content: its keys and values as written, its ``defaults`` list among them.
      config_path: its path in the config search path (``experiment/evil``); its defaults
        list's relative groups are relative to its group (``experiment``).
    """

    name: str
    trusted: bool
    package: str
    content: Any
    config_path: str = ""


HYDRA_WHY = (
    "Hydra acts on hydra.* before the run starts, so only the primary config, the command "
    f"line or an installed package may set it; other files may set {SWEEP_PARAMS} (over config "
    f"keys), {', '.join(SWEEP_SETTINGS)}"
)
FORGED_WHY = "Hydra records the real command line there, so no config file may set it"
LOCATION_WHY = (
    "it is a place the run writes to or connects to, which only the primary config or the "
    "command line may choose"
)
WIDEN_WHY = (
    f"only the primary config, the command line (+{ALLOWED_TARGETS_KEY}=[mypkg.]), "
    "XSHARD_ALLOWED_TARGETS or an installed package may widen the allowlist (a copied file may "
    "only repeat what they grant)"
)


def under(key: str, prefix: str) -> bool:
    """Whether the dotted `key` is `prefix` or lies inside it."""
    return key == prefix or key.startswith(prefix + ".")


def is_location(key: str) -> bool:
    """Whether setting `key` sets a location (`LOCATION_KEYS`; a ``*`` there stands for any
    one part, as the axis in ``reduction.axes.*.elastic.lighthouse``), or a node that holds one."""
    parts = key.split(".")
    return any(_nested(parts, loc.split(".")) for loc in LOCATION_KEYS)


def _nested(parts: list[str], loc: list[str]) -> bool:
    """Whether one of the dotted keys `parts` and `loc` (``*``: any part) lies in the other; a
    node above a ``*`` (``reduction``, ``reduction.axes``) does not count as holding it."""
    above = loc.index("*") if "*" in loc else len(loc)
    if len(parts) <= above < len(loc):
        return False
    return all(a == b or "*" in (a, b) for a, b in zip(parts, loc, strict=False))


def unsafe_resolvers(value: Any) -> list[str]:
    """The resolvers other than `SAFE_RESOLVERS` that a value written in a file calls."""
    texts = [value] if isinstance(value, str) else []
    if isinstance(value, list):
        texts = [v for v in value if isinstance(v, str)]
    return [n for t in texts for n in _RESOLVER_CALL.findall(t) if n not in SAFE_RESOLVERS]


def leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The dotted key and value of every leaf of `node` (an empty dict is a leaf)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def at_root(file: ComposedFile) -> dict[str, Any]:
    """`file`'s content placed at its package in the root config (its defaults list left out)."""
    content = file.content if isinstance(file.content, dict) else {}
    node: Any = {k: v for k, v in content.items() if k != "defaults"}
    for part in reversed(file.package.split(".") if file.package else []):
        node = {part: node}
    return node


def refusals(
    file: ComposedFile, granted: frozenset[str], declared: frozenset[str] | None
) -> list[Refusal]:
    """What `file` sets that its origin may not set (module docstring), in file order.

    Args:
      file: the file.
      granted: the ``allowed_targets`` entries trusted sources grant.
      declared: the top-level keys trusted sources declare; None: not checked (a saved
        config, whose every node its schema checks).
    """
    found = [r for r in _forged(file)]
    if file.trusted:
        return found
    found += _defaults_refusals(file)
    for key, value in leaves(at_root(file)):
        if under(key, FORGED_KEY):
            continue
        if under(key, SWEEP_PARAMS) and key != SWEEP_PARAMS:
            param = key[len(SWEEP_PARAMS) + 1 :]
            found += [Refusal(f"{SWEEP_PARAMS}.{r.key}", r.why) for r in _param(param, value)]
        elif key in SWEEP_SETTINGS:
            found += _sweep_setting(key, value)
        elif under(key, "hydra"):
            found.append(Refusal(key, HYDRA_WHY))
        else:
            found += _value_refusals(key, value, declared)
    widening = widening_entries(file, granted)
    if widening:
        found.append(
            Refusal(
                f"{ALLOWED_TARGETS_KEY} to {', '.join(widening)}",
                f"no trusted source grants {'it' if len(widening) == 1 else 'them'}: {WIDEN_WHY}",
            )
        )
    return found


def _forged(file: ComposedFile) -> Iterator[Refusal]:
    for key, value in leaves(at_root(file)):
        if under(key, FORGED_KEY) and (value or not file.trusted):
            yield Refusal(key, FORGED_WHY)


def _value_refusals(key: str, value: Any, declared: frozenset[str] | None) -> list[Refusal]:
    """A config key (not ``hydra``) set to `value` by a file that is not trusted."""
    root = key.split(".", 1)[0]
    if declared is not None and root not in declared and root != ALLOWED_TARGETS_KEY:
        return [
            Refusal(
                key,
                f"no trusted config declares a top-level key {root!r} (declared: "
                f"{sorted(declared)})",
            )
        ]
    if is_location(key):
        return [Refusal(key, LOCATION_WHY)]
    return [Refusal(key, _resolver_why(names)) for names in [unsafe_resolvers(value)] if names]


def _resolver_why(names: list[str]) -> str:
    return (
        f"its value calls the resolver {names[0]!r}, which reads outside the config (the "
        f"environment, files, the network); a copied file may use ${{key}} interpolations and "
        f"{', '.join(SAFE_RESOLVERS)} only"
    )


def _sweep_setting(key: str, value: Any) -> list[Refusal]:
    values = value if isinstance(value, list) else [value]
    if key.endswith("direction") and all(str(v).lower() in DIRECTIONS for v in values):
        return []
    if key.endswith("n_trials") and isinstance(value, int) and value >= 1:
        return []
    allowed = f"one of {list(DIRECTIONS)} (or a list of them)" if "direction" in key else ">= 1"
    return [Refusal(f"{key}={shown(value)}", f"expected {allowed}")]


def _param(param: str, value: Any) -> list[Refusal]:
    """One entry ``param: value`` of ``hydra.sweeper.params``: the override of every job it
    becomes must set a config key a copied file may set, to plain values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_override(f"{param}=0")
    except HydraException:
        return [Refusal(param, "not an override key (Hydra's override grammar)")]
    key = override.key_or_group.replace("/", ".")
    package = override.package or ""
    if under(key, "hydra") or under(package, "hydra") or under(package, "_global_.hydra"):
        return [Refusal(param, HYDRA_WHY)]
    if under(key, ALLOWED_TARGETS_KEY):
        return [Refusal(param, WIDEN_WHY)]
    if is_location(key) or (package and is_location(package)):
        return [Refusal(param, LOCATION_WHY)]
    if isinstance(value, dict):
        return [Refusal(param, "a sweep value must be a string, number or list, not a mapping")]
    names = unsafe_resolvers(value)
    return [Refusal(param, _resolver_why(names))] if names else []


def _defaults_refusals(file: ComposedFile) -> list[Refusal]:
    """Entries of the file's defaults list that choose a ``hydra/*`` group or place a config
    under ``hydra``: Hydra instantiates what those hold (launchers, sweepers, callbacks)."""
    content = file.content if isinstance(file.content, dict) else {}
    entries = content.get("defaults") or []
    found = []
    group = file.config_path.rpartition("/")[0]
    for entry in entries if isinstance(entries, list) else []:
        for spec in entry if isinstance(entry, dict) else [entry]:
            name, _, package = str(spec).split()[-1].partition("@")
            absolute = name[1:] if name.startswith("/") else f"{group}/{name}".strip("/")
            if under(absolute.replace("/", "."), "hydra") or under(package, "hydra"):
                found.append(Refusal(f"defaults: {spec}", HYDRA_WHY))
    return found


def widening_entries(file: ComposedFile, granted: frozenset[str]) -> list[str]:
    """The ``allowed_targets`` entries an untrusted `file` writes beyond `granted`.

    An entry that cannot be read in that file alone (an interpolation of a key set elsewhere,
    not a string) counts as widening.
    """
    from trainers.app.allowlist import file_entries

    root = at_root(file)
    if file.trusted or ALLOWED_TARGETS_KEY not in root:
        return []
    entries = file_entries(root[ALLOWED_TARGETS_KEY])
    return [
        repr(e) if e is not None else "an entry read elsewhere" for e in entries if e not in granted
    ]
