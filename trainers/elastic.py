"""`python -m trainers.elastic`: elastic replica groups on torchft (pip install 'xshard[elastic]').

    python -m trainers.elastic lighthouse --bind 127.0.0.1:29510 --min-groups 1
    python -m trainers.elastic run --groups 2 --out runs/elastic -- \\
        task=mlp mesh=cpu4_group reduction=diloco_elastic trainer.steps=64
    python -m trainers.elastic run --groups 2 --processes 2 --out runs/elastic -- ...

``lighthouse`` runs torchft's quorum server (torchft's own ``torchft_lighthouse`` does the
same); each group is then ``python -m trainers.train ... reduction=diloco_elastic
reduction.axes.slice.elastic.group=<id>``, one command per group (for a scheduler that restarts
failed jobs). ``run`` is a local supervisor: the lighthouse and N groups on this host, each
with its run dir ``<out>/group_<i>`` and log ``<out>/group_<i>.log``, a group that dies
restarted (it rejoins from a live peer); with ``--standby`` each group has a warm standby
process that takes over when it dies (``<out>/standby_<i>.log``). docs/reductions.md,
"Elastic replica groups".
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from trainers.exits import EXIT_CONFIG_ERROR


def _at_least_one(text: str) -> int:
    """An argument that counts something: a whole number >= 1 (argparse's ``type``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _lighthouse_args(parser: argparse.ArgumentParser) -> None:
    from trainers.cluster.elastic_launch import LighthouseOptions as Opts

    parser.add_argument("--bind", default=Opts.bind, help="host:port to listen on")
    parser.add_argument("--min-groups", type=int, default=Opts.min_groups, help="fewest groups")
    parser.add_argument(
        "--join-timeout-s", type=float, default=Opts.join_timeout_s, help="wait for stragglers"
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=Opts.heartbeat_timeout_s,
        help="drop a silent group after this",
    )


def parser() -> argparse.ArgumentParser:
    """The command line (``--help``)."""
    top = argparse.ArgumentParser(
        prog="python -m trainers.elastic",
        description="Elastic replica groups on torchft (needs pip install 'xshard[elastic]').",
    )
    commands = top.add_subparsers(dest="command", required=True)
    _lighthouse_args(commands.add_parser("lighthouse", help="run torchft's lighthouse"))
    run = commands.add_parser("run", help="the lighthouse and N groups, restarting any that dies")
    _lighthouse_args(run)
    run.add_argument("--groups", type=_at_least_one, required=True, help="how many replica groups")
    run.add_argument("--out", type=Path, required=True, help="run dirs and logs of the groups")
    run.add_argument("--axis", default="slice", help="the elastic axis (reduction.axes.<axis>)")
    run.add_argument("--restarts", type=int, default=3, help="restarts of one group at most")
    run.add_argument(
        "--processes",
        type=_at_least_one,
        default=1,
        help="jax.distributed processes per group (a coordinator per group on 127.0.0.1, "
        "gloo); a group restarts whole when one dies",
    )
    run.add_argument(
        "--standby",
        action="store_true",
        help="keep a warm standby per group (built and compiled ahead) that takes over when "
        "the group dies: a rejoin without start-up and tracing, for one more process per group "
        "(groups of one process)",
    )
    run.add_argument("overrides", nargs="*", help="trainers.train overrides (after --)")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns its exit status (2: the extra is not installed)."""
    from importlib.util import find_spec

    from trainers.app.elastic_group import EXTRA
    from trainers.cluster.elastic_launch import (
        GroupLaunch,
        LighthouseOptions,
        serve_lighthouse,
        supervise,
    )

    args = parser().parse_args(argv)
    if find_spec("torchft") is None:
        print(f"xshard: error: python -m trainers.elastic needs torchft: {EXTRA}.", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
    lighthouse = LighthouseOptions(
        args.bind, args.min_groups, args.join_timeout_s, args.heartbeat_timeout_s
    )
    if args.command == "lighthouse":
        return serve_lighthouse(lighthouse)
    if args.standby and args.processes > 1:
        print(
            f"xshard: error: --standby with --processes {args.processes}: a standby is one "
            "process; a group of several restarts whole, without one (drop --standby).",
            file=sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    launch = GroupLaunch(
        args.groups,
        args.out,
        tuple(args.overrides),
        args.axis,
        args.restarts,
        args.processes,
        args.standby,
    )
    return supervise(launch, lighthouse)


if __name__ == "__main__":
    sys.exit(main())
