"""Figures of the benchmarks' results, drawn from the JSON files they write.

``python -m benchmarks.plots`` (the last step of ``make bench``) reads the results in
``benchmarks/`` (or ``--dir``) and writes a PNG beside each; it measures nothing, so it can
redraw the committed results on its own:

* ``reductions_results.json`` -> ``reductions_results.png``: eval loss against the bytes per
  step that cross the slow mesh axis, per reduction; and the eval loss of every quality run;
* ``zero_results.json`` -> ``zero_results.png``: memory per device (params, optimizer state,
  temporaries) per ZeRO stage and model, with the step time against ZeRO-0;
* ``results.json`` -> ``results_overhead.png``: step time of xshard's steps as a ratio to
  the fastest hand-written step, per model, against the targets of `benchmarks.goals`.

matplotlib is the ``plots`` extra (``pip install 'xshard[plots]'``); without it the command
says so in one line and exits 0. Figures are drawn on their own `Figure` with the Agg canvas
(no pyplot state), `PANEL_INCHES` per panel at `DPI`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import goals
from benchmarks.reductions import SLOW_AXIS

HERE = Path(__file__).resolve().parent
DPI = 100
#: (width, height) in inches of one panel; a figure is one row of panels.
PANEL_INCHES = (6.0, 4.8)
KIB = 1024.0
MIB = 1024.0 * 1024.0


def figure_inches(panels: int) -> tuple[float, float]:
    """The (width, height) in inches of a figure of `panels` panels in a row."""
    return PANEL_INCHES[0] * panels, PANEL_INCHES[1]


def _figure(panels: int) -> tuple[Any, list[Any]]:
    """A new Agg figure with `panels` axes in a row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figure_inches(panels), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _machine(meta: dict[str, Any]) -> str:
    """Where the numbers come from, for a figure's title."""
    return (
        f"{meta.get('device_count')} x {meta.get('platform')} devices, "
        f"{meta.get('cpus_usable', '?')} CPUs, jax {meta.get('jax_version')}, "
        f"commit {meta.get('git_commit')}"
    )


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, format="png", dpi=DPI)
    return path


# ------------------------------------------------------------------ reductions


def plot_reductions(results: dict[str, Any], path: Path) -> Path:
    """`benchmarks.reductions`' results: eval loss (mean over seeds, whiskers the range)
    against KiB per step per device over the slow axis for the variants whose programs were
    measured; and the eval and train loss of every quality variant."""
    fig, (left, right) = _figure(2)
    quality = results["quality"]
    variants = quality["variants"]
    seeds = max(len(v["runs"]) for v in variants.values())
    for n, (name, q) in enumerate(variants.items()):
        measured = results["bytes"].get(name)
        if measured is None:
            continue
        x = measured["per_step"][SLOW_AXIS]["hierarchical_bytes"] / KIB
        ev = q["eval_loss"]
        yerr = [[ev["mean"] - ev["min"]], [ev["max"] - ev["mean"]]]
        left.errorbar(x, ev["mean"], yerr=yerr, fmt="o", color=f"C{n}", capsize=4, label=name)
    left.set_xscale("log")
    left.set_xlabel(f"KiB per step per device over `{SLOW_AXIS}` (hierarchical; log scale)")
    left.set_ylabel(f"eval loss after {quality['steps']} steps (mean of {seeds} seeds)")
    left.set_title("Eval loss against bytes over the slow axis")
    left.legend(fontsize="small", title="whiskers: range over seeds", title_fontsize="small")
    left.grid(alpha=0.3, which="both")

    names = list(variants)
    rows = range(len(names))
    train = f"train loss (last {quality['tail']} steps)"
    for key, face, label in (("eval_loss", "C0", "eval loss"), ("train_loss", "none", train)):
        stats = [variants[n][key] for n in names]
        means = [s["mean"] for s in stats]
        spread = [[s["mean"] - s["min"] for s in stats], [s["max"] - s["mean"] for s in stats]]
        right.errorbar(means, rows, xerr=spread, fmt="o", mfc=face, capsize=3, label=label)
    labels = [n if n in results["bytes"] else f"{n} (bytes not measured)" for n in names]
    right.set_yticks(list(rows), labels)
    right.invert_yaxis()
    right.set_xlabel(
        f"loss after {quality['steps']} steps (mean of {seeds} seeds; whiskers: range)"
    )
    right.set_title("Every quality run")
    right.legend(fontsize="small")
    right.grid(alpha=0.3, axis="x")
    fig.suptitle(f"Per-axis reductions, tiny_gpt: {_machine(results['meta'])}")
    return _save(fig, path)


# ------------------------------------------------------------------ ZeRO


_MEMORY = (
    ("params", lambda v: v["params_bytes_per_device"]),
    ("optimizer state", lambda v: v["opt_state_bytes_per_device"]),
    ("temporaries", lambda v: v["compiled"]["temp_size_in_bytes"]),
)


def plot_zero(results: dict[str, Any], path: Path) -> Path:
    """`benchmarks.zero`'s results: per model, the memory per device of each variant
    (stacked: params, optimizer state, compiled temporaries) and, above each bar, its step
    time against ZeRO-0 of the same implementation (ratio of medians)."""
    models = results["models"]
    fig, axes = _figure(len(models))
    for ax, (model, m) in zip(axes, models.items()):
        names = list(m["variants"])
        bottom = [0.0] * len(names)
        for n, (label, get) in enumerate(_MEMORY):
            sizes = [get(m["variants"][v]) / MIB for v in names]
            ax.bar(range(len(names)), sizes, bottom=bottom, color=f"C{n}", label=label)
            bottom = [b + s for b, s in zip(bottom, sizes)]
        for i, v in enumerate(names):
            timed = m["variants"][v].get("vs_replicated")  # none: measured by --bytes-only
            label = f"{timed['ratio_of_medians']:.2f}x" if timed else "not timed"
            ax.annotate(label, (i, bottom[i]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_ylabel("MiB per device")
        ax.set_ylim(0, max(bottom) * 1.12)
        logical = next(iter(m["variants"].values()))["params_bytes_logical"] / MIB
        ax.set_title(f"{model}: {m['devices']} data shards, params {logical:.2f} MiB")
        ax.grid(alpha=0.3, axis="y")
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=3,
        fontsize="small",
        title="above each bar: step time against zero0 of the same implementation",
        title_fontsize="small",
    )
    fig.suptitle(f"Memory per ZeRO stage (compiled programs): {_machine(results['meta'])}")
    return _save(fig, path)


# ------------------------------------------------------------------ step-time overhead


def _targets(task: str) -> dict[str, float]:
    """The targets of `benchmarks.goals` per variant of the overhead section."""
    return {"xshard_trainer_stats10": goals.DEFAULT_STEP[task], "xshard_trainer": goals.ALL_STATS}


def plot_overhead(results: dict[str, Any], path: Path) -> Path:
    """`benchmarks.run`'s overhead section: per model, each step's time as a ratio to the
    fastest hand-written step (bars: ratio of medians; whiskers: the interquartile range of
    the paired per-round ratios), the targets marked."""
    overhead = {k: v for k, v in results["sections"]["overhead"].items() if isinstance(v, dict)}
    fig, axes = _figure(len(overhead))
    for ax, (task, t) in zip(axes, overhead.items()):
        fastest = t["fastest_handwritten"]
        ratios = dict(t["ratio_to_fastest_handwritten"])
        ratios.update(
            {k: v for k, v in t["ratio_to_each_handwritten"][fastest].items() if k not in ratios}
        )
        names = list(ratios)
        heights = [ratios[n]["ratio_of_medians"] for n in names]
        whiskers = [
            [max(0.0, h - ratios[n]["paired_q1"]) for n, h in zip(names, heights)],
            [max(0.0, ratios[n]["paired_q3"] - h) for n, h in zip(names, heights)],
        ]
        colors = ["C0" if n.startswith("xshard") else "C7" for n in names]
        ax.bar(range(len(names)), heights, yerr=whiskers, color=colors, capsize=3)
        for i, n in enumerate(names):
            if n in _targets(task):
                ax.hlines(_targets(task)[n], i - 0.4, i + 0.4, colors="C3", linewidth=2)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_ylabel(f"step time / {fastest} (fastest hand-written)")
        ms = t["variants"][fastest]["median_ms"]
        ax.set_title(f"{task}: {fastest} {ms:.3g} ms/step")
        ax.grid(alpha=0.3, axis="y")
    _overhead_legend(fig)
    fig.suptitle(f"Step time against hand-written steps: {_machine(results['meta'])}")
    return _save(fig, path)


def _overhead_legend(fig: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color="C0", label="xshard (ratio of medians)"),
        Patch(color="C7", label="other hand-written step"),
        Line2D([], [], color="black", linestyle="--", label="fastest hand-written = 1"),
        Line2D([], [], color="C3", linewidth=2, label="target (benchmarks/goals.py)"),
        Line2D([], [], color="black", marker="|", linestyle="none", label="paired ratios, IQR"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=5, fontsize="small")


# ------------------------------------------------------------------ the command


#: Each results file, its figure's name beside it, and what draws it.
FIGURES: dict[str, tuple[str, Callable[[dict[str, Any], Path], Path]]] = {
    "reductions_results.json": ("reductions_results.png", plot_reductions),
    "zero_results.json": ("zero_results.png", plot_zero),
    "results.json": ("results_overhead.png", plot_overhead),
}


def redraw(directory: Path = HERE) -> list[Path]:
    """Draws the figure of each results file found in `directory`, beside it.

    Returns:
      The figures written.

    Raises:
      ImportError: matplotlib is not installed.
    """
    import matplotlib  # noqa: F401 - fail before reading anything if it is missing

    written = []
    for name, (figure, draw) in FIGURES.items():
        source = directory / name
        if source.is_file():
            written.append(draw(json.loads(source.read_text()), directory / figure))
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.plots [--dir DIR]``: draws the figures; 0 without matplotlib."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=HERE, help="where the results files are")
    args = parser.parse_args(argv)
    try:
        written = redraw(args.dir)
    except ImportError:
        print(
            "benchmarks.plots: figures skipped: matplotlib is not installed "
            "(pip install 'xshard[plots]')",
            file=sys.stderr,
        )
        return 0
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
