"""``python -m benchmarks.elastic_rejoin``: kill -> ``rejoined at step``, with and without a
warm standby.

Supervised runs (``python -m trainers.elastic run``, the real CLI, under ``nice -n 5`` as in
`benchmarks.elastic_goodput`) of 2 groups of ``--task``, alternating ``--standby`` and a plain
restart, `--rounds` of each, one shared compilation cache (warmed by a first run that is not
counted). In each run group 1 is killed (SIGKILL) once both groups committed syncs (and, with
``--standby``, once its standby logged that it is ready); the seconds from the kill to each
line of group 1's log that marks a section of its comeback (its time stamps) are recorded:
the standby taking over (or the restarted process's first line), its manager started
(``Replica group 1 of``), its join round (``joining its peers``) and ``rejoined at step``;
and the *stall* of the peer (group 0) at the rejoin: the seconds of its sync whose round group 1
rejoined in (``join_round_sync_s``: the quorum waited for group 1 to ask) and of its next sync
(``next_sync_s``: it waited for group 1's work after the heal), from group 0's ``Sync at step
N committed in X s`` lines. Writes JSON to ``--out`` (default
``benchmarks/elastic_rejoin_results.json``) with the load average at each kill.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.elastic_goodput import REPO, free_port
from benchmarks.elastic_logs import COMMIT, last_sync, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "elastic_rejoin_results.json"
#: The lines of a comeback, in order (the first line of a restarted process: any line).
MARKS = {
    "took_over": "Standby of group 1 taking over",
    "manager": "Replica group 1 of",
    "join_round": "Group 1 joining its peers",
    "rejoined": "Group 1 rejoined at step",
}
#: The step a rejoined group took from its peer (the peer's sync step of that round).
REJOINED = re.compile(r"Group 1 rejoined at step (\d+)")


def command(task: str, steps: int, out: Path, cache: Path, standby: bool) -> list[str]:
    """The supervisor's command line: 2 groups of `task`, DiLoCo every 8 steps."""
    return [
        "nice", "-n", "5", sys.executable, "-m", "trainers.elastic", "run",
        *(["--standby"] if standby else []),
        "--groups", "2", "--out", str(out), "--bind", f"127.0.0.1:{free_port()}",
        "--min-groups", "1", "--heartbeat-timeout-s", "1", "--join-timeout-s", "60", "--",
        f"task={task}", "mesh=cpu4_group", "reduction=diloco_elastic", "trainer.batch_size=16",
        f"trainer.steps={steps}", "trainer.progress=false", "checkpoint.enabled=false",
        f"trainer.compilation_cache_dir={cache}",
    ]  # fmt: skip


def wait_until(check: Any, what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def one_run(task: str, steps: int, out: Path, cache: Path, standby: bool) -> dict[str, Any]:
    """One supervised run: group 1 killed once; the seconds from the kill to each mark."""
    out.mkdir(parents=True)
    log1 = out / "group_1.log"
    with open(out.parent / f"{out.name}.supervisor.log", "w") as err:
        proc = subprocess.Popen(
            command(task, steps, out, cache, standby), cwd=REPO, stderr=err, start_new_session=True
        )
        try:
            wait_until(
                lambda: min(last_sync(text(out / f"group_{g}.log")) for g in (0, 1)) > 16, "syncs"
            )
            if standby:
                wait_until(lambda: "ready" in text(out / "standby_1.log"), "the standby")
            before = last_sync(text(out / "group_0.log"))
            wait_until(lambda: last_sync(text(out / "group_0.log")) > before, "a sync")
            offset = log1.stat().st_size
            load = os.getloadavg()[0]
            os.kill(int((out / "group_1.pid").read_text()), signal.SIGKILL)
            killed = time.time()
            wait_until(lambda: MARKS["rejoined"] in text(log1)[offset:], "the rejoin")
            step = int(REJOINED.findall(text(log1)[offset:])[0])
            wait_until(lambda: last_sync(text(out / "group_0.log")) >= step + 8, "the next sync")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor, its groups and standbys
            proc.wait(timeout=120)
    lines = text(log1)[offset:].splitlines()
    stamped = [(t, ln) for ln in lines if (t := stamp(ln)) is not None]
    seconds = {"first_line": round(stamped[0][0] - killed, 2)}
    for name, mark in MARKS.items():
        found = [t for t, ln in stamped if mark in ln]
        if found:
            seconds[name] = round(found[0] - killed, 2)
    return {
        "standby": standby,
        "load_avg_at_kill": load,
        "seconds_after_kill": seconds,
        "peer_stall_s": peer_stall(text(out / "group_0.log"), step),
    }


def peer_stall(log0: str, step: int) -> dict[str, float]:
    """Group 0's syncs at the rejoin: the one whose round group 1 rejoined in (at `step`)
    and the next (module docstring), their seconds from group 0's commit lines."""
    synced = {int(m.group(1)): float(m.group(2)) for m in COMMIT.finditer(log0)}
    nxt = min((s for s in synced if s > step), default=None)
    return {
        "join_round_sync_s": synced.get(step, float("nan")),
        "next_sync_s": synced[nxt] if nxt is not None else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic_rejoin")
    parser.add_argument("--task", default="mlp", help="task (default mlp)")
    parser.add_argument("--steps", type=int, default=100000, help="steps (the run is stopped)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each kind")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="elastic_rejoin_") as tmp:
        cache = Path(tmp) / "jax_cache"
        one_run(args.task, args.steps, Path(tmp) / "warm", cache, standby=False)  # the cache
        for r in range(args.rounds):
            for standby in (r % 2 == 0, r % 2 == 1):  # interleaved, the order alternating
                name = f"{'standby' if standby else 'plain'}_{r}"
                runs.append(one_run(args.task, args.steps, Path(tmp) / name, cache, standby))
                print(json.dumps(runs[-1]), flush=True)
    results = {"meta": {"task": args.task, "cpus": os.cpu_count()}, "runs": runs}
    prior = json.loads(args.out.read_text()) if args.out.exists() else {}
    prior[args.task] = results
    args.out.write_text(json.dumps(prior, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
