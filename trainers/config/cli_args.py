"""The command line of this process as Hydra reads it: what the user typed, and where.

Read by the trust rules (`trainers.app.allowlist`: entries typed on the command line widen the
allowlist), by run names (`trainers.config.run_names`: which keys a sweep varies), by HParams
(`run_overrides`, handed to `trainers.hooks.hparams` by the app) and by every path a user typed
(`launch_dir`). An override's key (and value) is read by Hydra's own parser, in one place
(`override_key`, `override_assignment`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def argv_overrides(argv: list[str] | None = None) -> list[str]:
    """The overrides of this process's command line, parsed as Hydra's main parses them.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      The positional overrides; none if `argv` is not a Hydra command line (a launcher's
      worker process).
    """
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    except SystemExit:  # not Hydra's arguments
        return []
    return [o for o in args.overrides if isinstance(o, str)]


def parsed_overrides(lines: Iterable[str]) -> list[Any]:
    """Hydra's `Override` of each line that Hydra's parser reads (the others are left out:
    Hydra reports them itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for line in lines:
        try:
            out.append(parser.parse_override(line))
        except HydraException:
            continue
    return out


def override_key(line: str) -> str:
    """The key (or group) an override sets, as Hydra's parser reads it: ``+a.b=1`` -> ``a.b``,
    ``~a`` -> ``a``, ``group@pkg=x`` -> ``group@pkg``; for a line Hydra cannot parse, the text
    before its first ``=``, without ``+``/``~``."""
    parsed = parsed_overrides([line])
    if not parsed:
        return line.split("=", 1)[0].lstrip("+~")
    return _key(parsed[0])


def override_assignment(line: str) -> tuple[str, Any] | None:
    """The key an override sets (as `override_key` reads it) and its value, as Hydra's parser
    reads them: ``+a.b=[1,2]`` -> ``("a.b", [1, 2])``, ``a=null`` -> ``("a", None)``; None for
    a line that sets no one value (no ``=`` or no key, a deletion ``~a``, a sweep ``a=1,2``,
    a line Hydra cannot parse)."""
    parsed = parsed_overrides([line])
    if not parsed or not parsed[0].key_or_group:
        return None
    override = parsed[0]
    if override.is_delete() or override.is_sweep_override():
        return None
    return _key(override), override.value()


def _key(override: Any) -> str:
    """A parsed override's key or group, with its ``@package`` if it names one."""
    package = f"@{override.package}" if override.package is not None else ""
    return f"{override.key_or_group}{package}"


def swept_keys(argv: list[str] | None = None) -> frozenset[str]:
    """The keys (or groups) that the command line's sweep overrides vary (``lr=0.1,0.2``,
    ``optimizer=sgd,adam``, ``lr=interval(0, 1)``); none outside a Hydra command line."""
    return frozenset(
        o.key_or_group for o in parsed_overrides(argv_overrides(argv)) if o.is_sweep_override()
    )


def launch_dir() -> Path:
    """The directory the user's command ran in: ``hydra.runtime.cwd`` inside a Hydra job
    (Hydra records it before it changes into the run dir), else the working directory."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        cwd = HydraConfig.get().runtime.cwd
        if cwd:
            return Path(str(cwd))
    return Path.cwd()


@dataclasses.dataclass(frozen=True)
class RunOverrides:
    """What a Hydra job was asked for, as plain values (`run_overrides`).

    Attributes:
      overrides: ``(key, value as text)`` of each of ``hydra.overrides.task``, in order;
        deletions (``~key``) left out.
      choices: the config groups' choices (``{"optimizer": "adamw", ...}``), without Hydra's
        own ``hydra/*`` and the internal ``xshard_schemas/*``.
      excluded: the keys Hydra leaves out of directory names
        (``hydra.job.config.override_dirname.exclude_keys``).
    """

    overrides: tuple[tuple[str, str], ...] = ()
    choices: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    excluded: frozenset[str] = frozenset()


def run_overrides() -> RunOverrides | None:
    """This Hydra job's `RunOverrides`; None outside a Hydra job (the compose API)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    choices = {
        k: v
        for k, v in hc.runtime.choices.items()
        if not k.startswith(("hydra/", "xshard_schemas/"))
    }
    overrides = tuple(
        (o.key_or_group, o.get_value_element_as_str())
        for o in parsed_overrides(list(hc.overrides.task))
        if not o.is_delete()
    )
    excluded = frozenset(str(k) for k in hc.job.config.override_dirname.exclude_keys)
    return RunOverrides(overrides, choices, excluded)
