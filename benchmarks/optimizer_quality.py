"""``python -m benchmarks.optimizer_quality [--smoke] [--out PATH]``: optimizer quality (issue 36).

On 8 simulated CPU devices, tiny_gpt at the CLI's defaults (``mesh=cpu8``, ``reduction=mean``,
``trainer.batch_size`` and the warmup-cosine schedule over ``trainer.steps``), each optimizer of
`benchmarks.workloads.CLI_OPTIMIZERS` composed as a user types it (``optimizer=<name>``;
``schedule=constant`` for schedule-free AdamW, which refuses a decaying schedule) with its own
CLI-default learning rate, is trained for the same steps on the same batches (the seed draws
the init and the data) for 3 seeds, as `benchmarks.reduction_runs` trains the reductions'
quality runs (`Run`: the CLI's ``build_run``, plain steps). Per optimizer: the final training
loss (mean of the last `tail` updates), the eval loss of the params the trainer evaluates
(schedule-free AdamW's evaluation params, `trainers.core.periodic.outer_params`), their mean
and range over the seeds and the gap to adamw, and the median wall milliseconds per update
(the first, compiling, left out; the runs are sequential, so compare these across a loaded
machine with care: section 8 of ``benchmarks.run`` interleaves the step times).

Writes JSON to ``--out`` (default ``benchmarks/optimizers_results.json``) and the Markdown
next to it, and prints it. ``--smoke`` shrinks the model, steps and seeds: its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.env import configure_devices, environment, load_average, write_results
from benchmarks.reduction_runs import QualityPlan
from benchmarks.workloads import CLI_OPTIMIZERS

DEFAULT_OUT = Path(__file__).resolve().parent / "optimizers_results.json"
BASELINE = "adamw"
#: Every run starts from the CLI's defaults but the task: tiny_gpt, 192 updates, 3 seeds.
FULL = QualityPlan(("task=tiny_gpt",), (), 192, (0, 1, 2), 16)
#: --smoke: task=mlp (every optimizer's step and eval programs compile in a second or two where
#: even a one-layer tiny_gpt's take several on 2 cores), 4 updates, one seed.
SMOKE = QualityPlan(("task=mlp",), (), 4, (0,), 2)


def composed(overrides: tuple[str, ...], plan: QualityPlan) -> dict[str, Any]:
    """What a run of `overrides` trains with, read from its composed config: the optimizer's
    factory and learning rate, the schedule's factory and the global batch."""
    from benchmarks.reduction_runs import compose_config

    cfg = compose_config([*overrides, *plan.model, f"trainer.steps={plan.steps}"], plan.base)
    return {
        "overrides": list(overrides),
        "optimizer": cfg.optimizer._target_,
        "learning_rate": float(cfg.optimizer.learning_rate),
        "schedule": cfg.schedule._target_,
        "global_batch_size": int(cfg.trainer.batch_size),
        "task": cfg.task.name,
    }


def measure(plan: QualityPlan) -> dict[str, Any]:
    """Every optimizer trained and evaluated as `plan` says, with gaps to adamw and the
    ratio of its median step milliseconds to adamw's."""
    from benchmarks.reduction_runs import train_variants, with_gaps

    quality = with_gaps(train_variants(CLI_OPTIMIZERS, plan), BASELINE)
    base_ms = quality["variants"][BASELINE]["step_ms"]["mean"]
    for name, v in quality["variants"].items():
        v["settings"] = composed(CLI_OPTIMIZERS[name], plan)
        v["step_ms"][f"vs_{BASELINE}"] = round(v["step_ms"]["mean"] / base_ms, 3)
    return quality


def render(results: dict[str, Any]) -> str:
    """The results as Markdown: the quality table, then the settings and step times."""
    from benchmarks.reduction_report import quality_table

    meta, quality = results["meta"], results["quality"]
    lines = [
        "# Optimizers at the CLI's defaults (`python -m benchmarks.optimizer_quality`)",
        "",
        f"{meta['mode']} run on {meta.get('device_count')} {meta.get('platform')} devices "
        f"({meta.get('cpus_usable')} usable CPUs), mesh cpu8, jax "
        f"{meta.get('jax_version')}, {meta.get('date_utc')}, commit {meta.get('git_commit')}, "
        f"load average {meta.get('load_average_start')} -> {meta.get('load_average_end')}, "
        f"{meta['wall_s']:.0f} s",
        "",
        *quality_table(quality, BASELINE, task=quality["variants"][BASELINE]["settings"]["task"]),
        "",
        "## Settings and step time (sequential runs: median ms per update, first left out)",
        "",
        "| variant | overrides | optimizer | learning rate | schedule | task, batch | "
        "ms/step (mean over seeds) | vs adamw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in quality["variants"].items():
        s, ms = v["settings"], v["step_ms"]
        lines.append(
            f"| {name} | `{' '.join(s['overrides'])}` | `{s['optimizer']}` | "
            f"{s['learning_rate']:g} | `{s['schedule'].rsplit('.', 1)[-1]}` | "
            f"{s['task']}, {s['global_batch_size']} | {ms['mean']:.1f} "
            f"({ms['min']:.1f}-{ms['max']:.1f}) | {ms[f'vs_{BASELINE}']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Trains every optimizer, writes the JSON and Markdown, prints the Markdown; returns 0."""
    configure_devices()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.optimizer_quality", description=__doc__
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, one seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    start, env = time.perf_counter(), environment()
    env["load_average_start"] = load_average()
    quality = measure(plan)
    meta = {
        **env,
        "mode": "smoke" if args.smoke else "full",
        "load_average_end": load_average(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    results = {"meta": meta, "settings": plan._asdict(), "quality": quality}
    write_results(args.out, results, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
