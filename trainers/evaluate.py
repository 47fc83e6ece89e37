"""`python -m trainers.evaluate <run dir> [step=N] [--export params.npz] [overrides]`:
evaluate a saved checkpoint, and export its params.

    python -m trainers.evaluate outputs/2025-01-01/12-00-00              # the latest checkpoint
    python -m trainers.evaluate runs/a step=200 trainer.eval_batches=100
    python -m trainers.evaluate runs/a --export params.npz               # and write the params
    python -m trainers.evaluate runs/a '+allowed_targets=[my_experiments.]'   # your own code
                                     # (or its package's entry point: docs/tasks.md)

Evaluates the checkpoint on the task's eval split (every example once), prints the metrics
and writes them to ``<run dir>/eval_step<N>.json``; ``--export`` also writes the params to a
``.npz`` keyed by parameter path (``np.load`` reads it without xshard). The run's saved
config is untrusted input (`trainers.app.run_dir_config`): a ``_target_`` outside the
allowlist is refused before anything is imported, and only the command line,
``XSHARD_ALLOWED_TARGETS`` or an installed package widens it. The logic is
`trainers.app.checkpoint_use`. Exit status (`trainers.exits`): 0 done; 2 not a run dir, no
such step, a bad or untrusted config, an unusable checkpoint; 1 an unexpected error.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from trainers.exits import EXIT_CONFIG_ERROR

USAGE = "usage: python -m trainers.evaluate RUN_DIR [step=N] [--export FILE.npz] [key=value ...]"


class Arguments(NamedTuple):
    """The command line: the run dir, the step (None: latest), the export file, overrides."""

    run_dir: str
    step: int | None
    export: str | None
    overrides: list[str]


def parse(argv: list[str]) -> Arguments:
    """Parses `argv` (without the program name).

    Raises:
      ConfigError: a missing run dir or ``--export`` file, a bad ``step=``, or an unknown flag.
    """
    from xshard.errors import ConfigError

    rest, export, step = [], None, None
    args = iter(argv)
    for arg in args:
        if arg == "--export" or arg.startswith("--export="):
            export = arg.partition("=")[2] or next(args, "")
            if not export:
                raise ConfigError(f"--export needs a file name. {USAGE}")
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}. {USAGE}")
        elif arg.startswith("step="):
            value = arg.partition("=")[2]
            if not value.isdigit():
                raise ConfigError(f"step={value!r}: expected a checkpoint step (an integer).")
            step = int(value)
        else:
            rest.append(arg)
    if not rest or "=" in rest[0]:
        raise ConfigError(f"no run dir given. {USAGE}")
    return Arguments(rest[0], step, export, rest[1:])


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit status (one line on stderr for a bad input)."""
    import logging

    from trainers.exits import CheckpointError
    from xshard.config import one_line
    from xshard.errors import ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        from trainers.app.checkpoint_use import evaluate_checkpoint, export_params, load

        result = evaluate_checkpoint(args.run_dir, args.step, args.overrides)
        print(
            f"step {result.step}: " + ", ".join(f"{k}={v:.6g}" for k, v in result.metrics.items())
        )
        print(f"wrote {result.path}")
        if args.export:
            loaded = load(args.run_dir, result.step, args.overrides)
            written = export_params(loaded.params, args.export)
            print(f"exported the params of step {loaded.step} to {written}")
    except (ConfigError, CheckpointError) as e:
        print(f"xshard: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
