"""The logs of supervised elastic runs (``python -m trainers.elastic run``) as numbers.

Each group's log (``group_<g>.log`` in the run's ``--out``) stamps every line; a sync logs its
start and its commit (`trainers.core.periodic.group_sync`), a rejoin, a failed round, an
evaluation and the group's start. `measure` turns one run's logs and its kills into the
numbers `benchmarks.elastic_goodput` reports; `benchmarks.elastic_rejoin` reads the stamps.
"""

from __future__ import annotations

import re
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
COMMIT = re.compile(r"Sync at step (\d+) committed in ([\d.]+) s, the mean over ([\d.]+) groups")
START = re.compile(r"Sync at step (\d+): exchanging")
EVAL = re.compile(r"Eval at step (\d+) .*eval/loss=([\d.]+)")


class Shape(NamedTuple):
    """What reading a run's logs needs of its settings: the number of groups and the steps
    between syncs."""

    groups: int
    every: int


def stamp(line: str) -> float | None:
    """The epoch seconds of a log line's ``[YYYY-mm-dd HH:MM:SS,mmm]`` (local time), or None."""
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def log_of(out: Path, group: int) -> str:
    path = out / f"group_{group}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def last_sync(text: str) -> int:
    """The last step a group's log says it committed a sync at (0: none)."""
    steps = [int(m.group(1)) for m in COMMIT.finditer(text)]
    return max(steps, default=0)


def rejoined_since(text: str, group: int, since: float) -> bool:
    """Whether a group's log says it rejoined after the epoch seconds `since`."""
    lines = [ln for ln in text.splitlines() if f"Group {group} rejoined at step" in ln]
    return any((stamp(ln) or 0.0) > since for ln in lines)


def events(text: str) -> dict[str, list[tuple[float, ...]]]:
    """A group's log as timed events: sync starts (t, step), commits (t, step, seconds,
    groups), rejoins (t,), failed rounds (t,), evals (t, step, loss), starts (t,)."""
    found: dict[str, list[tuple[float, ...]]] = {
        k: [] for k in ("start", "commit", "rejoin", "failed", "eval", "incarnation")
    }
    for line in text.splitlines():
        t = stamp(line)
        if t is None:
            continue
        if m := START.search(line):
            found["start"].append((t, int(m.group(1))))
        elif m := COMMIT.search(line):
            found["commit"].append((t, int(m.group(1)), float(m.group(2)), float(m.group(3))))
        elif m := EVAL.search(line):
            found["eval"].append((t, int(m.group(1)), float(m.group(2))))
        elif "rejoined at step" in line:
            found["rejoin"].append((t,))
        elif "sync not committed" in line:
            found["failed"].append((t,))
        elif "Replica group" in line:
            found["incarnation"].append((t,))
    return found


def seconds_per_step(commits: list[tuple[float, ...]], every: int) -> float:
    """A group's median seconds per step, its syncs included (the median of the seconds
    between consecutive commits, over `every`: a stall is an outlier)."""
    gaps = [(b[0] - a[0]) / every for a, b in zip(commits, commits[1:], strict=False)]
    return statistics.median(gaps) if gaps else 0.0


def measure(shape: Shape, out: Path, kills: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One run's numbers (`benchmarks.elastic_goodput`'s docstring) from its groups' logs in
    `out` and its `kills` (group, epoch seconds), `wall` the supervisor's seconds."""
    s = shape
    ev = [events(log_of(out, g)) for g in range(s.groups)]
    firsts = [min((c[0] for c in e["commit"] if c[1] == s.every), default=None) for e in ev]
    t0 = max(t for t in firsts if t is not None)
    commits = [c for e in ev for c in e["commit"]]
    t1 = max(c[0] for c in commits)
    weight: dict[float, float] = {}  # sync step -> the groups its mean is over
    for c in commits:
        weight[c[1]] = max(weight.get(c[1], 0.0), c[3])
    committed = sum(w * s.every for step, w in weight.items() if step > s.every)
    lost = 0.0
    for k in kills:
        mine = [c for c in ev[k["group"]]["commit"] if c[0] < k["at"]]
        pace = seconds_per_step(mine, s.every)
        since = k["at"] - mine[-1][0] if mine else 0.0
        lost += min(s.every, since / pace) if pace > 0 else s.every
    failed = sum(len(e["failed"]) for e in ev)
    per_kill = []
    for k in kills:
        others = [c for g, e in enumerate(ev) if g != k["group"] for c in e["commit"]]
        after = [c for c in others if c[0] - c[2] >= k["at"]]
        stall = max((c[2] for c in after if c[0] - c[2] < k["at"] + 5.0), default=0.0)
        rejoins = [r[0] for r in ev[k["group"]]["rejoin"] if r[0] > k["at"]]
        rejoin = min(rejoins) - k["at"] if rejoins else None
        at_rejoin = [c[2] for c in others if rejoins and 0 <= c[0] - min(rejoins) < 30.0]
        per_kill.append(
            {"group": k["group"], "stall_s": round(stall, 2),
             "rejoin_s": None if rejoin is None else round(rejoin, 2),
             "rejoin_stall_s": round(max(at_rejoin, default=0.0), 2)}
        )  # fmt: skip
    evals = [e["eval"][-1][2] for e in ev if e["eval"]]
    curve = sorted({(int(x[1]), x[2]) for e in ev for x in e["eval"]})  # equal in every group
    paces = [seconds_per_step(e["commit"], s.every) for e in ev]
    ideal = sum((t1 - t0) / p for p in paces if p > 0)
    return {
        "wall_s": round(wall, 1),
        "window_s": round(t1 - t0, 1),
        "committed_group_steps": committed,
        "attempted_group_steps": round(committed + lost + failed * s.every, 1),
        "committed_per_s": round(committed / (t1 - t0), 2),
        "goodput_own_pace": round(committed / ideal, 3),
        "median_sync_s": round(statistics.median(c[2] for c in commits), 3),
        "restarts": sum(len(e["incarnation"]) for e in ev) - s.groups,
        "failed_rounds": failed,
        "kills": per_kill,
        "final_eval_loss": evals,
        "eval_curve": [list(x) for x in curve],
    }
