"""The Markdown tables of `benchmarks.reductions` (bytes per axis, quality, step time)."""

from __future__ import annotations

from typing import Any


def _kib(b: float | None) -> str:
    return "-" if b is None else f"{b / 1024:,.1f}"


def _ops(programs: dict[str, Any], program: str, axis: str) -> str:
    ops = programs.get(program, {}).get(axis, {}).get("ops", {})
    return ", ".join(f"{k} x{n}" for k, n in sorted(ops.items())) or "none"


def bytes_table(section: dict[str, Any]) -> list[str]:
    """Section 1: per variant, the collectives over `slice` and the bytes per step per axis."""
    lines = [
        "## Bytes per step crossing each axis (from the compiled programs)",
        "",
        "Per device; per step = inner program + sync program / H. *flat*: every collective "
        "spanning the axis charged whole; *hier.*: what a hierarchical algorithm sends over the "
        "axis itself (`benchmarks/axis_traffic.py`).",
        "",
        "| variant | H | inner: over slice | sync: over slice | slice KiB/step flat | "
        "slice KiB/step hier. | data KiB/step | mean / variant (flat) | mean / variant (hier.) "
        "| logged comm/slice/bytes_per_step KiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in section.items():
        s, d, r = v["per_step"]["slice"], v["per_step"]["data"], v["ratio_to_mean"]
        lines.append(
            f"| {name} | {v['every_steps']} | {_ops(v['programs'], 'inner', 'slice')} | "
            f"{_ops(v['programs'], 'sync', 'slice')} | {_kib(s['flat_bytes'])} | "
            f"{_kib(s['hierarchical_bytes'])} | {_kib(d['flat_bytes'])} | "
            f"{r['flat_bytes']} | {r['hierarchical_bytes']} | "
            f"{_kib(v['logged_bytes_per_step'])} |"
        )
    return lines


def quality_table(section: dict[str, Any], base: str = "mean", task: str = "tiny_gpt") -> list[str]:
    """Section 2: train and eval loss, mean +- std over seeds, range and gap to variant `base`
    (`benchmarks.reduction_runs.with_gaps`); `task`: the task the runs trained."""
    gap = f"vs_{base}"
    lines = [
        f"## Quality: {task}, {section['steps']} steps, same tokens "
        f"(train loss: mean of the last {section['tail']} steps)",
        "",
        f"| variant | seeds | train loss | train range | vs {base} | eval loss | eval range | "
        f"vs {base} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in section["variants"].items():
        t, e = v["train_loss"], v["eval_loss"]
        lines.append(
            f"| {name} | {len(v['runs'])} | {t['mean']:.4f} +- {t['std']:.4f} | "
            f"{t['min']:.4f}-{t['max']:.4f} | {t[gap]:+.4f} | "
            f"{e['mean']:.4f} +- {e['std']:.4f} | {e['min']:.4f}-{e['max']:.4f} | "
            f"{e[gap]:+.4f} |"
        )
    return lines


def timing_table(section: dict[str, Any]) -> list[str]:
    """Section 3: median ms of each program, paired ratio to the synchronous step."""
    lines = [
        "## Step time (interleaved, medians)",
        "",
        "| program | median ms | IQR ms | vs mean step (paired median) |",
        "|---|---|---|---|",
    ]
    for name, p in section["programs"].items():
        lines.append(
            f"| {name} | {p['median_ms']:.2f} | {p['iqr_ms']:.2f} | "
            f"{p['vs_mean_step']['paired_median']:.3f} |"
        )
    lines += [
        "",
        "| variant | H | inner + sync / H, ms per step | vs mean step |",
        "|---|---|---|---|",
    ]
    for name, a in section["amortized"].items():
        lines.append(
            f"| {name} | {a['every_steps']} | {a['per_step_ms']:.2f} | {a['vs_mean_step']:.3f} |"
        )
    return lines


def added_rows(meta: dict[str, Any]) -> list[str]:
    """A line per ``--quality-only`` run merged into the results: its rows, date and commit."""
    added = meta.get("quality_added", [])
    if not added:
        return []
    return [
        "",
        *(
            f"Rows {', '.join(a['variants'])}: added by `--quality-only` on {a['date_utc']}, "
            f"commit {a['git_commit']}."
            for a in added
        ),
    ]


def render(results: dict[str, Any]) -> str:
    """The results as Markdown."""
    meta = results["meta"]
    lines = [
        "# Per-axis reductions (`python -m benchmarks.reductions`)",
        "",
        f"{meta.get('mode')} run on {meta.get('device_count')} {meta.get('platform')} devices "
        f"({meta.get('cpus_usable')} usable CPUs), mesh cpu2x4_slices (slice 2 x data 4), "
        f"jax {meta.get('jax_version')}, {meta.get('date_utc')}, commit {meta.get('git_commit')}",
        "",
        *bytes_table(results["bytes"]),
        "",
        *quality_table(results["quality"]),
        *added_rows(meta),
        "",
        *timing_table(results["timing"]),
    ]
    return "\n".join(lines) + "\n"
