"""The command line of this process as Hydra's main parses it: what the user typed.

Read by the trust rules (`trainers.app.allowlist`: entries typed on the command line widen the
allowlist) and by run names (`trainers.config.run_names`: which keys a sweep varies).
"""

from __future__ import annotations

import sys


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


def swept_keys(argv: list[str] | None = None) -> frozenset[str]:
    """The keys (or groups) that the command line's sweep overrides vary (``lr=0.1,0.2``,
    ``optimizer=sgd,adam``, ``lr=interval(0, 1)``); none outside a Hydra command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    keys = set()
    for line in argv_overrides(argv):
        try:
            override = parser.parse_override(line)
        except HydraException:
            continue
        if override.is_sweep_override():
            keys.add(override.key_or_group)
    return frozenset(keys)
