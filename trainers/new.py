"""`python -m trainers.new DIR [--package NAME]`: write a ready experiment repo on xshard.

    python -m trainers.new lm-study                  # the package lm_study in ./lm-study
    python -m trainers.new ~/code/exp --package lm   # another package name
    cd lm-study && make install && make train && make test

The repo: a pyproject (``xshard[flax,grain]`` as a dependency, the ``xshard.allowed_targets``
entry point), ``train.py`` (``@trainers.main``), ``conf/train.yaml`` composing
``xshard_train``, a Flax NNX model and Grain data following ``precision`` and
``trainer.remat``, an experiment, a sweep, tests and a Makefile (`trainers.app.scaffold`).
DIR must be new or empty: nothing is overwritten. Exit status: 0 written; 2 a bad DIR or name
(one line on stderr).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from trainers.exits import EXIT_CONFIG_ERROR

USAGE = "usage: python -m trainers.new DIR [--package NAME]"


class Arguments(NamedTuple):
    """The command line: the target dir and the package name (None: from the dir's name)."""

    root: str
    package: str | None


def parse(argv: list[str]) -> Arguments:
    """Parses `argv` (without the program name).

    Raises:
      ConfigError: no DIR, more than one, ``--package`` without a name, or an unknown flag.
    """
    from xshard.errors import ConfigError

    roots, package = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--package" or arg.startswith("--package="):
            package = arg.partition("=")[2] or next(args, "")
            if not package:
                raise ConfigError(f"--package needs a name. {USAGE}")
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}. {USAGE}")
        else:
            roots.append(arg)
    if len(roots) != 1:
        raise ConfigError(f"expected one DIR, got {len(roots)}. {USAGE}")
    return Arguments(roots[0], package)


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns its exit status (one line on stderr for a bad input)."""
    from trainers.app.scaffold import write
    from xshard.config import one_line
    from xshard.errors import ConfigError

    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        repo = write(args.root, args.package)
    except ConfigError as e:
        print(f"xshard: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(f"Wrote an experiment repo (package {repo.package}) to {repo.root}:")
    print(f"  cd {args.root} && make install && make train && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
