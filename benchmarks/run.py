"""``python -m benchmarks.run [--smoke] [--out PATH] [--only NAME,...] [--tasks NAME,...]``
(``make bench``).

Runs the benchmark sections (see `benchmarks.sections.SECTIONS`) in one process on every
device present (8 simulated CPU devices on the CPU platform), writes the results as JSON to
``--out`` and as Markdown tables next to it (same name, ``.md``), and prints the tables.

``--smoke`` runs every section once with tiny models and step counts: it checks that the
benchmark still works (CI), its numbers mean nothing. The exit status is 1 if a section
failed (its error is recorded in the JSON and the other sections still run).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.env import configure_devices, environment, load_average
from benchmarks.workloads import TASKS

DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"


def parse_args(
    argv: list[str] | None, section_names: list[str], tasks: tuple[str, ...] = TASKS
) -> argparse.Namespace:
    """Parses the command line; `--only` must name sections from `section_names`, `--tasks`
    workloads from `tasks`."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--smoke", action="store_true", help="one tiny iteration of everything")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated sections to run (default: all): {','.join(section_names)}",
    )
    parser.add_argument(
        "--tasks",
        default=",".join(tasks),
        help=f"comma-separated workloads the sections run (default: all): {','.join(tasks)}",
    )
    args = parser.parse_args(argv)
    args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not args.tasks or set(args.tasks) - set(tasks):
        parser.error(f"--tasks: expected some of {list(tasks)}, got {list(args.tasks)}")
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in section_names]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; allowed: {section_names}")
    args.sections = [s for s in section_names if s in only] if only else list(section_names)
    return args


def _finite(tree: Any, path: str = "", bad: list[str] | None = None) -> Any:
    """`tree` with NaN/inf floats replaced by None (JSON has none); their paths go to `bad`."""
    if isinstance(tree, dict):
        return {k: _finite(v, f"{path}/{k}", bad) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_finite(v, f"{path}/{i}", bad) for i, v in enumerate(tree)]
    if isinstance(tree, float) and not math.isfinite(tree):
        if bad is not None:
            bad.append(path)
        return None
    return tree


def main(argv: list[str] | None = None) -> int:
    """Runs the selected sections; writes JSON and Markdown; returns the exit status."""
    configure_devices()  # before JAX initialises its backends (only sizes the CPU client)

    from benchmarks.context import Bench, Settings
    from benchmarks.report import render
    from benchmarks.sections import SECTIONS

    args = parse_args(argv, list(SECTIONS))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    bench = Bench(Settings(smoke=args.smoke, tasks=args.tasks))
    meta = {
        **environment(),
        "mode": "smoke" if args.smoke else "full",
        "sections_run": args.sections,
        "load_average_start": load_average(),
        "section_wall_s": {},
    }
    sections: dict[str, Any] = {}
    failed = []
    start = time.perf_counter()
    for name in args.sections:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            sections[name] = SECTIONS[name](bench)
        except Exception as e:  # recorded, reported, and the exit status says so
            traceback.print_exc()
            sections[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        meta["section_wall_s"][name] = round(time.perf_counter() - t0, 2)
        print(
            f"[bench] {name} done in {meta['section_wall_s'][name]} s", file=sys.stderr, flush=True
        )
    meta["wall_s"] = round(time.perf_counter() - start, 2)
    meta["load_average_end"] = load_average()
    meta["failed_sections"] = failed

    bad: list[str] = []
    results = _finite({"meta": meta, "sections": sections}, bad=bad)
    results["meta"]["nonfinite_paths"] = bad
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    markdown = render(results)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"[bench] wrote {args.out} and {args.out.with_suffix('.md')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
