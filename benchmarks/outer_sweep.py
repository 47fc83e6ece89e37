"""``python -m benchmarks.outer_sweep [--steps N] [--seeds 0 1 2] [--out PATH]``: DiLoCo's outer
optimizer swept (issue 34 item 3).

Outer Nesterov SGD's learning rate {0.3, 0.5, 0.7, 1.0} x momentum {0, 0.9} x H (every_steps)
{4, 8, 16, 32} on ``task=tiny_gpt mesh=cpu2x4_slices reduction=diloco``, and the synchronous
``mean`` beside it, on each seed; the same steps and tokens for every run
(`benchmarks.reduction_runs`: each run is built by the CLI's code, eval loss of the outer params
on the task's eval batches). The outer rate and momentum are inputs of the compiled programs
(`xshard.optim.hyperparams`): with JAX's persistent compilation cache in a temporary dir, each H
compiles its programs once and the other runs read them back.

Writes JSON to ``--out`` (default ``benchmarks/outer_sweep_results.json``) and the Markdown table
next to it, and prints the table. Each finished run is written as it ends, so an interrupted
sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.env import configure_devices, environment, load_average

DEFAULT_OUT = Path(__file__).resolve().parent / "outer_sweep_results.json"
RATES = (0.3, 0.5, 0.7, 1.0)
MOMENTA = (0.0, 0.9)
EVERY = (4, 8, 16, 32)
OUTER = "reduction.axes.slice"


def variant_name(every: int, rate: float, momentum: float) -> str:
    """The results key of one DiLoCo setting."""
    return f"H={every} lr={rate} m={momentum}"


def variants() -> dict[str, tuple[str, ...]]:
    """Every run's Hydra overrides by name: ``mean``, then the DiLoCo grid H-major (runs of one
    H share their compiled programs)."""
    out: dict[str, tuple[str, ...]] = {"mean": ("reduction=mean",)}
    for every, rate, momentum in itertools.product(EVERY, RATES, MOMENTA):
        out[variant_name(every, rate, momentum)] = (
            "reduction=diloco",
            f"{OUTER}.every_steps={every}",
            f"{OUTER}.outer_optimizer.learning_rate={rate}",
            f"{OUTER}.outer_optimizer.momentum={momentum}",
        )
    return out


def summarise(runs: list[dict[str, Any]], base: float | None) -> dict[str, Any]:
    """Mean, std and range of the runs' eval loss, and the mean's gap to `base`."""
    x = np.asarray([r["eval_loss"] for r in runs], np.float64)
    mean = float(x.mean())
    return {
        "eval_loss": round(mean, 4),
        "std": round(float(x.std(ddof=1)) if len(x) > 1 else 0.0, 4),
        "min": round(float(x.min()), 4),
        "max": round(float(x.max()), 4),
        "vs_mean": None if base is None else round(mean - base, 4),
    }


def render(results: dict[str, Any]) -> str:
    """The Markdown table: one row per (H, momentum), one column per outer rate (eval loss,
    its gap to ``mean``), the best rate of each H in bold."""
    v = results["variants"]
    if "mean" not in v:
        return "(no runs yet)\n"
    base = v["mean"]["summary"]
    meta = results["meta"]
    lines = [
        f"# DiLoCo outer optimizer sweep: {meta['steps']} steps, seeds {meta['seeds']}",
        "",
        f"tiny_gpt, mesh=cpu2x4_slices, outer Nesterov SGD; eval loss of the outer params (mean "
        f"over seeds), its gap to `mean` in brackets. `mean`: {base['eval_loss']} +- "
        f"{base['std']}.",
        "",
        "| H | momentum | " + " | ".join(f"lr {r}" for r in RATES) + " |",
        "|---:|---:|" + "---:|" * len(RATES),
    ]
    for every in EVERY:
        names = {(r, m): variant_name(every, r, m) for r in RATES for m in MOMENTA}
        done = {k: v[n]["summary"] for k, n in names.items() if n in v}
        best = min(done, key=lambda k: done[k]["eval_loss"]) if done else None
        for m in MOMENTA:
            cells = []
            for r in RATES:
                s = done.get((r, m))
                cell = "-" if s is None else f"{s['eval_loss']:.3f} ({s['vs_mean']:+.3f})"
                cells.append(f"**{cell}**" if (r, m) == best else cell)
            lines.append(f"| {every} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep, writing the results after every run; returns the exit status."""
    configure_devices()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.outer_sweep", description=__doc__)
    parser.add_argument("--steps", type=int, default=192, help="updates per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tail", type=int, default=16, help="train loss: mean of the last N")
    parser.add_argument("--only", nargs="+", help="run only these variant names")
    parser.add_argument("--model", nargs="*", default=[], help="extra task overrides")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    args = parser.parse_args(argv)

    from benchmarks.reduction_runs import train_and_evaluate
    from trainers.core.compile_cache import enable_compilation_cache

    meta = {**environment(), "steps": args.steps, "seeds": args.seeds, "model": args.model}
    meta["load_average_start"] = load_average()
    results: dict[str, Any] = {"meta": meta, "variants": {}}
    todo = {k: o for k, o in variants().items() if not args.only or k in args.only}
    with tempfile.TemporaryDirectory(prefix="outer_sweep_cache_") as cache:
        enable_compilation_cache(Path(cache))
        for name, overrides in todo.items():
            start = time.perf_counter()
            runs = [
                train_and_evaluate([*overrides, *args.model], args.steps, seed, args.tail).__dict__
                for seed in args.seeds
            ]
            base = results["variants"].get("mean", {}).get("summary", {}).get("eval_loss")
            results["variants"][name] = {"runs": runs, "summary": summarise(runs, base)}
            seconds = time.perf_counter() - start
            print(f"[outer_sweep] {name}: {runs} ({seconds:.0f} s)", file=sys.stderr, flush=True)
            meta["load_average_end"] = load_average()
            args.out.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
            args.out.with_suffix(".md").write_text(render(results))
        enable_compilation_cache(None)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
