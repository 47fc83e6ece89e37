"""`main`: ``@hydra.main`` with xshard's guards, for its entry points and your own.

``python -m trainers.train`` and ``python -m trainers.doctor`` are built with it; decorate your
own experiment repo's main with it too (docs/config.md). Around Hydra's own main it:

1. latches stop signals from the moment the module is decorated
   (`trainers.cluster.signal_latch`), so a SIGTERM or Ctrl-C during imports or composition stops
   the run before its first step;
2. checks every config file Hydra composes before Hydra acts on any of it
   (`trainers.app.config_guard`): a copied file cannot run code through ``hydra.*`` keys, forge
   the command line in ``hydra.overrides`` or widen ``allowed_targets`` (exit 2, one line);
3. hands the ``allowed_targets`` entries typed on the command line to the processes a launcher
   starts (through ``XSHARD_ALLOWED_TARGETS``, `trainers.app.allowlist`);
4. reports an override that does not fit the schema (a wrong type, an unknown key) in one
   line with exit 2 (`trainers.app.override_errors`), not Hydra's report and exit 1;
5. refuses ``--experimental-rerun``, which unpickles a run dir's ``config.pickle`` (a pickle
   from a copied run dir runs code): rerun with the overrides of ``.hydra/overrides.yaml``;
6. reports, in one line, a stop signal that came after the run had ended;
7. registers the resolvers xshard's configs use (also where Hydra's plugin scan did not run),
   ``${xshard.help:}`` of ``--help`` among them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from trainers.cluster import signal_latch


def main(
    config_path: str | None, config_name: str | None, version_base: str | None = "1.3"
) -> Callable[[Callable[[Any], Any]], Callable[[], Any]]:
    """Decorates a task function as ``@hydra.main`` does, with the guards of this module.

        @trainers.main(config_path="conf", config_name="my_exp")
        def main(cfg):
            return trainers.run(cfg)

    Args:
      config_path: as ``hydra.main``'s (relative to the decorated function's file, or
        ``pkg://...``).
      config_name: the primary config's name.
      version_base: as ``hydra.main``'s.

    Returns:
      A decorator; the function it returns takes no arguments and reads ``sys.argv`` as
      Hydra's main does.
    """
    signal_latch.install()

    def decorate(task_function: Callable[[Any], Any]) -> Callable[[], Any]:
        import hydra

        from trainers.app.help import register_help_resolver
        from trainers.config.resolvers import register_resolvers

        register_resolvers()
        register_help_resolver()

        hydra_main = hydra.main(
            config_path=config_path, config_name=config_name, version_base=version_base
        )(task_function)

        @functools.wraps(task_function)
        def entry() -> Any:
            from trainers.app.allowlist import export_command_line_entries
            from trainers.app.config_guard import guard_compositions
            from trainers.app.override_errors import readable_overrides
            from trainers.exits import EXIT_CONFIG_ERROR

            signal_latch.install()
            refuse_rerun(EXIT_CONFIG_ERROR)
            try:
                export_command_line_entries()
                with guard_compositions(EXIT_CONFIG_ERROR), readable_overrides(EXIT_CONFIG_ERROR):
                    return hydra_main()
            finally:
                signal_latch.report_unhandled()

        return entry

    return decorate


def refuse_rerun(exit_code: int, argv: list[str] | None = None) -> None:
    """Exits with `exit_code` and one line if the command line asks Hydra to
    ``--experimental-rerun`` a pickled config: unpickling a file runs whatever code it names,
    and run dirs are copied between people (docs/reliability.md)."""
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--experimental-rerun" or a.startswith("--experimental-rerun=") for a in args):
        print(
            "xshard: error: --experimental-rerun unpickles the run's config.pickle, and a "
            "pickle runs the code it names: refused. Rerun with the run's overrides instead "
            "(.hydra/overrides.yaml), or resume it with hydra.run.dir=<run dir>.",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(exit_code)
