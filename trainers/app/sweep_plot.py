"""The sweep's figure: its objective against each swept key, next to ``sweep_summary.md``.

`SweepSummary` (`trainers.app.sweep`) draws it from the same ``result.json`` records as the
table: one panel per key whose value differs between the jobs (read from each record's
``overrides``), numbers on a numeric axis (a log axis when they span more than 10x), other
values (group choices, strings, ``null``) as categories; the best job marked (following
``hydra.sweeper.direction``); jobs without a finite objective left out and counted in the
title. With no swept key (one job so far), the objective is drawn against the job number.

matplotlib is optional (``pip install 'xshard[plots]'``) and imported only here, when a
figure is drawn: without it `draw_objective` raises `ImportError` and the sweep goes on
without the figure. The figure is drawn on its own `Figure` with the Agg canvas (no pyplot
state: headless, and safe in any thread) and written through the run dir's no-follow rule
(`trainers.rundir.links.write_file`): a link planted at its path is replaced, never written
through.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from trainers.config.cli_args import override_key
from trainers.rundir.links import write_file

#: The figure, in the sweep dir next to the table.
SWEEP_FIGURE_FILE = "sweep_objective.png"
#: What installs matplotlib.
PLOTS_EXTRA = "pip install 'xshard[plots]'"
#: Pixels per inch of the figure; each panel is `PANEL_INCHES`, at most `MAX_COLUMNS` a row.
DPI = 100
PANEL_INCHES = (4.5, 3.6)
MAX_COLUMNS = 3
#: Values spanning more than this ratio get a log axis.
LOG_SPAN = 10.0


class SweptKey(NamedTuple):
    """A key whose value differs between the jobs of a sweep."""

    name: str
    values: list[str | None]  # per record, as typed; None where a job did not set it
    numeric: bool  # every value that is set is a finite number
    log: bool  # numeric, all positive, and spanning more than `LOG_SPAN`


def overrides_of(record: dict[str, Any]) -> dict[str, str]:
    """A job's overrides as ``{key: value}`` (``+``/``~`` prefixes dropped; a deletion
    without a value is left out)."""
    out = {}
    for override in record.get("overrides") or []:
        _, sep, value = str(override).partition("=")  # the value as typed
        if sep:
            out[override_key(str(override))] = value
    return out


def _number(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def swept_keys(records: Sequence[dict[str, Any]]) -> list[SweptKey]:
    """The keys whose values differ between `records`, in the order the jobs name them."""
    per_record = [overrides_of(r) for r in records]
    names = list(dict.fromkeys(k for overrides in per_record for k in overrides))
    keys = []
    for name in names:
        values = [overrides.get(name) for overrides in per_record]
        if len(set(values)) < 2:
            continue
        numbers = [_number(v) for v in values if v is not None]
        numeric = all(n is not None for n in numbers)
        finite = [n for n in numbers if n is not None]
        log = numeric and min(finite) > 0 and max(finite) > LOG_SPAN * min(finite)
        keys.append(SweptKey(name, values, numeric, log))
    return keys


def finite_objective(record: dict[str, Any]) -> float | None:
    """A job's objective if it is a finite number, else None."""
    value = record.get("objective")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def figure_inches(panels: int) -> tuple[float, float]:
    """The figure's (width, height) in inches for `panels` panels."""
    columns = min(panels, MAX_COLUMNS)
    rows = math.ceil(panels / MAX_COLUMNS)
    return PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows


def _objective_name(records: Sequence[dict[str, Any]]) -> str | None:
    """``trainer.objective`` as the jobs recorded it (``train/loss``, ``eval/loss``)."""
    return next((str(r["objective_key"]) for r in records if r.get("objective_key")), None)


def _title(records: Sequence[dict[str, Any]], plotted: int, maximize: bool) -> str:
    objective = _objective_name(records)
    what = f"{objective}, " if objective else ""
    title = (
        f"Sweep objective ({what}{'maximize' if maximize else 'minimize'}): "
        f"{plotted} of {len(records)} jobs"
    )
    left_out = len(records) - plotted
    if left_out:
        title += f"; {left_out} without a finite objective left out"
    return title


def _draw_panel(
    ax: Any, key: SweptKey | None, points: list[tuple[int, float]], best: tuple[int, str]
) -> None:
    """One panel: the objective of the jobs `points` (job number or index into the records,
    objective) against `key` (None: the job number); the job ``best[0]`` starred, labelled
    ``best[1]``."""
    xs: list[float] = []
    ys: list[float] = []
    best_xy = None
    categories: list[str] = []
    for i, y in points:
        if key is None:
            x: float = i
        else:
            value = key.values[i]
            if value is None:
                continue
            if key.numeric:
                x = float(value)
            else:
                categories += [] if value in categories else [value]
                x = categories.index(value)
        xs.append(x)
        ys.append(y)
        if i == best[0]:
            best_xy = (x, y)
    ax.scatter(xs, ys, color="C0", alpha=0.8, label="job")
    if best_xy is not None:
        ax.scatter(*best_xy, marker="*", s=260, color="C3", zorder=3, label=best[1])
    if key is None:
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("job")
    elif key.numeric:
        ax.set_xscale("log" if key.log else "linear")
        ax.set_xlabel(key.name + (" (log scale)" if key.log else ""))
    else:
        ax.set_xticks(range(len(categories)), [c[:24] for c in categories], rotation=20)
        ax.set_xlim(-0.5, len(categories) - 0.5)
        ax.set_xlabel(key.name)
    ax.grid(alpha=0.3)


class ObjectiveFigure(NamedTuple):
    """What the sweep's figure shows, before anything is drawn."""

    panels: list[SweptKey | None]  # a panel per swept key; [None]: against the job number
    points: list[tuple[int, float]]  # (index into the records, or job number; objective)
    best: int  # the best job's first element in `points`
    best_label: str  # "best: job 3, 0.37266"
    y_label: str
    title: str


def objective_figure(
    records: Sequence[dict[str, Any]], *, maximize: bool = False
) -> ObjectiveFigure | None:
    """What the figure of `records` shows (module doc); None if no job has a finite objective."""
    points = [(i, y) for i, r in enumerate(records) if (y := finite_objective(r)) is not None]
    if not points:
        return None
    best = (max if maximize else min)(points, key=lambda p: p[1])
    label = f"best: job {records[best[0]].get('num', best[0])}, {best[1]:.5g}"
    panels: list[SweptKey | None] = list(swept_keys(records)) or [None]
    if panels == [None]:  # against the job number
        points = [(int(records[i].get("num", i)), y) for i, y in points]
        best = (int(records[best[0]].get("num", best[0])), best[1])
    y_label = f"objective: {_objective_name(records) or 'final loss'}"
    title = _title(records, len(points), maximize)
    return ObjectiveFigure(panels, points, best[0], label, y_label, title)


def draw_objective(records: Sequence[dict[str, Any]], *, maximize: bool = False) -> bytes | None:
    """The sweep's figure as PNG bytes (`objective_figure`, drawn on `figure_inches` at
    `DPI`), or None if no job has a finite objective.

    Raises:
      ImportError: matplotlib is not installed (``pip install 'xshard[plots]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = objective_figure(records, maximize=maximize)
    if shown is None:
        return None
    panels = shown.panels
    fig = Figure(figsize=figure_inches(len(panels)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    columns = min(len(panels), MAX_COLUMNS)
    axes = fig.subplots(math.ceil(len(panels) / columns), columns, sharey=True, squeeze=False)
    for n, ax in enumerate(axes.ravel()):
        if n >= len(panels):
            ax.set_visible(False)
            continue
        _draw_panel(ax, panels[n], shown.points, (shown.best, shown.best_label))
        if n % columns == 0:
            ax.set_ylabel(shown.y_label)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(shown.title, fontsize="medium")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def write_objective_figure(
    records: Sequence[dict[str, Any]], path: str | Path, *, maximize: bool = False
) -> Path | None:
    """Draws the sweep's figure (`draw_objective`) and writes it to `path` atomically, never
    through a link (`write_file`).

    Returns:
      `path`, or None if no job has a finite objective yet (nothing written).

    Raises:
      ImportError: matplotlib is not installed.
      OSError: the file could not be written.
    """
    png = draw_objective(records, maximize=maximize)
    return None if png is None else write_file(path, png)
