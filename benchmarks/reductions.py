"""``python -m benchmarks.reductions [--smoke] [--out PATH]``: per-axis reductions (issue 25).

On 8 simulated CPU devices, mesh ``cpu2x4_slices`` (axes ``slice`` 2 x ``data`` 4), tiny_gpt,
every run built from the Hydra configs as the CLI builds it (`benchmarks.reduction_runs`):

1. ``bytes``: what crosses each mesh axis per step, read from the compiled inner and sync
   programs (`benchmarks.axis_traffic`): the synchronous ``mean`` against ``local_sgd`` H=8 and
   H=32, ``diloco_int8`` and its int4 variant (H=8), also with ``sharding.zero_stage=1`` (outer
   state sharded over ``data``). Per step over ``slice`` = inner program + sync program / H.
2. ``quality``: final training loss (mean of the last updates) and eval loss of the outer params
   of ``mean``, ``diloco`` H=8 and H=32, ``diloco_int8`` and its int4 variant, ``local_sgd``
   H=8, same steps and tokens, 3 seeds.
3. ``timing``: step time of the inner and sync programs against the synchronous step, side by
   side in one process (`benchmarks.timing.interleave`, medians).

Writes JSON to ``--out`` (default ``benchmarks/reductions_results.json``) and the Markdown
tables next to it (`benchmarks.reduction_report`), and prints them. ``--smoke`` shrinks the
model, the steps and the seeds (CI): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from benchmarks.env import configure_devices, environment, write_results

DEFAULT_OUT = Path(__file__).resolve().parent / "reductions_results.json"
AXES = ("slice", "data")
SLOW_AXIS = "slice"

#: The runs whose programs are measured, by name: their Hydra overrides.
BYTES_VARIANTS: dict[str, tuple[str, ...]] = {
    "mean": ("reduction=mean",),
    "local_sgd H=8": ("reduction=local_sgd",),
    "local_sgd H=32": ("reduction=local_sgd", "reduction.axes.slice.every_steps=32"),
    "diloco_int8 H=8": ("reduction=diloco_int8",),
    "diloco_int4 H=8": ("reduction=diloco_int8", "reduction.axes.slice.comm_dtype=int4"),
    "mean zero1": ("reduction=mean", "sharding.zero_stage=1"),
    "local_sgd H=8 zero1": ("reduction=local_sgd", "sharding.zero_stage=1"),
    "diloco_int8 H=8 zero1": ("reduction=diloco_int8", "sharding.zero_stage=1"),
}
#: The runs trained for quality, by name.
QUALITY_VARIANTS: dict[str, tuple[str, ...]] = {
    "mean": ("reduction=mean",),
    "diloco H=8": ("reduction=diloco",),
    "diloco H=32": ("reduction=diloco", "reduction.axes.slice.every_steps=32"),
    "diloco_int8 H=8": ("reduction=diloco_int8",),
    "diloco_int4 H=8": ("reduction=diloco_int8", "reduction.axes.slice.comm_dtype=int4"),
    "local_sgd H=8": ("reduction=local_sgd",),  # the outer step without momentum: plain averaging
    # MuLoCo (arXiv 2505.23725): Muon inside DiLoCo, and Muon's synchronous baseline.
    "muon mean": ("optimizer=muon", "reduction=mean"),
    "muon diloco_int8 H=8": ("optimizer=muon", "reduction=diloco_int8"),
    "muon diloco_int4 H=8": (
        "optimizer=muon",
        "reduction=diloco_int8",
        "reduction.axes.slice.comm_dtype=int4",
    ),
}
#: The runs whose programs are timed (from BYTES_VARIANTS).
TIMED = ("mean", "local_sgd H=8", "diloco_int8 H=8")


class Settings(NamedTuple):
    """How much to run: which variants, model overrides, steps and seeds of the quality runs,
    the timing plan."""

    bytes_variants: tuple[str, ...]  # names of BYTES_VARIANTS (TIMED among them)
    quality_variants: tuple[str, ...]  # names of QUALITY_VARIANTS ("mean" first)
    model: tuple[str, ...]
    steps: int
    seeds: tuple[int, ...]
    tail: int  # the final training loss averages this many last updates
    plan: tuple[int, int, int]  # benchmarks.timing.Plan: warm-up blocks, rounds, steps/block


FULL = Settings(tuple(BYTES_VARIANTS), tuple(QUALITY_VARIANTS), (), 192, (0, 1, 2), 16, (1, 12, 4))


def smoke_settings() -> Settings:
    """--smoke: the timed variants and two quality ones, the small model, 16 steps, one seed,
    one timed round (each run compiles its programs: that is most of the time)."""
    from benchmarks.reduction_runs import SMOKE_OVERRIDES

    return Settings(TIMED, ("mean", "diloco H=8"), SMOKE_OVERRIDES, 16, (0,), 4, (1, 1, 1))


def _per_step(inner: Any, sync: Any, every: int) -> dict[str, float]:
    """Bytes per device per step over an axis: the inner program's every step, the sync's
    every `every` steps (`benchmarks.axis_traffic.AxisTraffic` of each; sync may be None)."""
    out = {}
    for kind in ("flat_bytes", "hierarchical_bytes"):
        value = getattr(inner, kind) + (getattr(sync, kind) / every if sync is not None else 0.0)
        out[kind] = round(value, 2)
    return out


def measure_bytes(runs: dict[str, Any]) -> dict[str, Any]:
    """Section 1: per variant, each program's traffic per axis and the per-step bytes."""
    from benchmarks.axis_traffic import collectives_by_axis, traffic
    from trainers.core.periodic import BYTES_TAG, outer_params

    out: dict[str, Any] = {}
    for name, run in runs.items():
        shape = dict(run.mesh.shape)
        per_program = {}
        for program, compiled in run.programs().items():
            found = collectives_by_axis(compiled.as_text(), shape)
            per_program[program] = {axis: traffic(found, axis) for axis in AXES}
        every = run.every_steps
        sync = per_program.get("sync", {})
        params = outer_params(run.state)
        logged = run.last_metrics.host_values().get(BYTES_TAG.format(axis=SLOW_AXIS))
        out[name] = {
            "every_steps": every,
            "param_bytes": int(sum(x.size * x.dtype.itemsize for x in _leaves(params))),
            "programs": {
                p: {axis: dataclasses.asdict(t) for axis, t in a.items()}
                for p, a in per_program.items()
            },
            "per_step": {
                axis: _per_step(per_program["inner"][axis], sync.get(axis), every) for axis in AXES
            },
            "logged_bytes_per_step": logged,
        }
    base = out["mean"]["per_step"][SLOW_AXIS]
    for v in out.values():
        mine = v["per_step"][SLOW_AXIS]
        v["ratio_to_mean"] = {
            k: round(base[k] / mine[k], 2) if mine[k] else None
            for k in ("flat_bytes", "hierarchical_bytes")
        }
    return out


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


def measure_quality(settings: Settings) -> dict[str, Any]:
    """Section 2: every quality variant trained for `settings.steps` on each seed, with its
    gap to ``mean``."""
    return with_gaps_to_mean(train_quality(settings))


def train_quality(settings: Settings) -> dict[str, Any]:
    """Every quality variant of `settings` trained for `settings.steps` on each seed."""
    from benchmarks.reduction_runs import BASE_OVERRIDES, QualityPlan, train_variants

    plan = QualityPlan(
        BASE_OVERRIDES, settings.model, settings.steps, settings.seeds, settings.tail
    )
    return train_variants({n: QUALITY_VARIANTS[n] for n in settings.quality_variants}, plan)


def with_gaps_to_mean(quality: dict[str, Any]) -> dict[str, Any]:
    """Sets each variant's ``vs_mean``: its loss minus the ``mean`` variant's."""
    from benchmarks.reduction_runs import with_gaps

    return with_gaps(quality, "mean")


def merge_quality(out: Path, names: list[str]) -> dict[str, Any]:
    """--quality-only: trains only the quality variants `names` (FULL's steps and seeds) and
    merges them into the results already at `out`, noting when and where in its meta."""
    unknown = sorted(set(names) - set(QUALITY_VARIANTS))
    if unknown:
        raise SystemExit(
            f"--quality-only: unknown variants {unknown}; allowed: {list(QUALITY_VARIANTS)}"
        )
    results = json.loads(out.read_text())
    fresh = train_quality(FULL._replace(quality_variants=tuple(names)))
    results["quality"]["variants"].update(fresh["variants"])
    with_gaps_to_mean(results["quality"])
    env = environment()
    added = {"variants": names, "date_utc": env["date_utc"], "git_commit": env["git_commit"]}
    results["meta"].setdefault("quality_added", []).append(added)
    return results


def measure_timing(runs: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Section 3: the inner and sync programs against the synchronous step, interleaved."""
    from benchmarks.reduction_runs import InnerLoop, SyncLoop
    from benchmarks.timing import Plan, interleave, ratio

    loops: list[Any] = []
    for name in TIMED:
        run = runs[name]
        if run.trainer.periodic is None:
            loops.append(InnerLoop(f"{name} step", run))
        else:
            loops += [InnerLoop(f"{name} inner", run), SyncLoop(f"{name} sync", run)]
    timings = interleave(loops, Plan(*settings.plan))
    base = timings["mean step"]
    out: dict[str, Any] = {"plan": list(settings.plan), "programs": {}, "amortized": {}}
    for name, t in timings.items():
        out["programs"][name] = {**t.summary(), "vs_mean_step": ratio(t, base)}
    for name in TIMED[1:]:
        every = runs[name].every_steps
        inner, sync = timings[f"{name} inner"].samples, timings[f"{name} sync"].samples
        per_step = np.median(inner) + np.median(sync) / every
        out["amortized"][name] = {
            "every_steps": every,
            "per_step_ms": round(float(per_step) * 1e3, 4),
            "vs_mean_step": round(float(per_step / np.median(base.samples)), 4),
        }
    return out


def build_runs(settings: Settings) -> dict[str, Any]:
    """Every `BYTES_VARIANTS` run after one update and one sync (both programs compiled)."""
    from benchmarks.reduction_runs import Run

    runs = {}
    for name in settings.bytes_variants:
        run = Run([*BYTES_VARIANTS[name], *settings.model])
        run.train(1)
        if run.trainer.periodic is not None:
            run.force_sync()
        runs[name] = run
    return runs


def main(argv: list[str] | None = None) -> int:
    """Runs the three sections; writes JSON and Markdown; returns the exit status."""
    configure_devices()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reductions", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, one seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    parser.add_argument(
        "--quality-only",
        nargs="+",
        metavar="VARIANT",
        help="train only these quality variants and merge them into --out's results",
    )
    args = parser.parse_args(argv)

    from benchmarks.reduction_report import render

    if args.quality_only:
        write_results(args.out, merge_quality(args.out, args.quality_only), render)
        return 0
    settings = smoke_settings() if args.smoke else FULL
    runs = build_runs(settings)
    results = {
        "meta": {**environment(), "mode": "smoke" if args.smoke else "full"},
        "bytes": measure_bytes(runs),
        "timing": measure_timing(runs, settings),
    }
    del runs
    results["quality"] = measure_quality(settings)
    write_results(args.out, results, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
