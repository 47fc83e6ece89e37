"""An 8-trial learning rate x weight decay sweep of ``task=mlp``, Hydra's basic launcher
against ``hydra/launcher=population``, and one trial alone:
``python -m benchmarks.population [--task T] [--steps N] [--out PATH] [--override K=V ...]
[--smoke]`` -> benchmarks/population_results.json (``--task tiny_gpt``:
population_results_tiny_gpt.json). ``--override`` adds a key to every run (on an accelerator
``mesh=auto``: benchmarks/device_check.sh's population stage); ``--smoke`` runs the
population only, of 2 trials, 3 steps (the stage's dry run: does it still run?). The file is
written after each run, so a run cut short by a time limit leaves the runs before it.

Each is one CLI process (``python -m trainers.train``), each with its own empty
``trainer.compilation_cache_dir`` (so the basic launcher's jobs 2..8 read the first job's
programs from the cache, as a user's sweep does). Per process: the wall time; per job, from
its ``result.json``: the status, the final loss, ``compile_time_s`` and the programs compiled
(cache misses). The population's trials end within 1e-5 relative of the basic launcher's
final losses (``final_loss_max_rel_diff``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.env import load_average

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
#: Training steps per job, by task.
STEPS = {"mlp": 50, "tiny_gpt": 20}
SWEEP = ["optimizer=adamw", "optimizer.learning_rate=1e-3,3e-3,1e-2,3e-2"]
SWEEP += ["optimizer.weight_decay=0,1e-2"]
#: ``--smoke``: the population of 2 trials, a few steps.
SMOKE_SWEEP, SMOKE_STEPS = ["optimizer=adamw", "optimizer.learning_rate=1e-3,1e-2"], 3


def run_cli(overrides: list[str], out_dir: Path, timeout: float = 1800) -> dict[str, Any]:
    """One CLI process: its wall time and each job's ``result.json`` facts, by job number."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.train", *overrides],
        cwd=ROOT,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{overrides} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    jobs = {}
    for path in out_dir.rglob("result.json"):
        record = json.loads(path.read_text())
        jobs[record.get("num") or 0] = {
            "status": record["status"],
            "final_loss": record["final_loss"],
            "compile_time_s": record["compile_time_s"],
            "cache_misses": record["compilation_cache_misses"],
        }
    return {"wall_s": round(wall, 2), "jobs": dict(sorted(jobs.items()))}


def measure(
    task: str,
    steps: int,
    work: Path,
    runs: dict[str, list[str]],
    report: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Each of `runs` (name: its overrides, e.g. `sweep_runs`), calling ``report(results so
    far)`` after each (if given); then, of those present, the population's final losses against the
    basic launcher's and both launchers' wall time over one trial's."""
    common = [f"trainer.steps={steps}", "trainer.progress=false", f"task={task}"]
    common.append("checkpoint=none")
    out: dict[str, Any] = {}
    for name, overrides in runs.items():
        run = work / name
        key = "hydra.sweep.dir" if overrides[0] == "-m" else "hydra.run.dir"
        args = [*overrides, *common, f"{key}={run}"]
        args.append(f"trainer.compilation_cache_dir={work / f'cache_{name}'}")
        out[name] = run_cli(args, run)
        print(name, out[name]["wall_s"], flush=True)
        if report is not None:
            report(out)
    if "basic" in out and "population" in out:
        basic, population = out["basic"]["jobs"], out["population"]["jobs"]
        out["final_loss_max_rel_diff"] = max(
            abs(basic[j]["final_loss"] - population[j]["final_loss"]) / abs(basic[j]["final_loss"])
            for j in basic
        )
    for name in ("population", "basic"):
        if name in out and "one_trial" in out:
            ratio = out[name]["wall_s"] / out["one_trial"]["wall_s"]
            out[f"{name}_wall_over_one_trial"] = round(ratio, 2)
    return out


def sweep_runs(sweep: list[str], overrides: list[str], smoke: bool) -> dict[str, list[str]]:
    """The runs of `measure`: one trial alone, the population, the basic launcher (`smoke`:
    the population only), each with `overrides`."""
    runs = {
        "one_trial": ["optimizer=adamw", "optimizer.learning_rate=1e-3", *overrides],
        "population": ["-m", "hydra/launcher=population", *sweep, *overrides],
        "basic": ["-m", *sweep, *overrides],
    }
    return {"population": runs["population"]} if smoke else runs


def main(argv: list[str] | None = None) -> None:
    """Runs `measure` in a temporary dir and writes the JSON (``--out``) after each run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.population")
    parser.add_argument("--task", choices=sorted(STEPS), default="mlp")
    parser.add_argument("--steps", type=int, help="training steps per job (default: by task)")
    parser.add_argument("--out", type=Path, help="default: population_results[_<task>].json")
    parser.add_argument("--override", action="append", default=[], help="K=V for every run")
    parser.add_argument("--smoke", action="store_true", help="the population of 2, 3 steps")
    args = parser.parse_args(argv)
    steps = args.steps or (SMOKE_STEPS if args.smoke else STEPS[args.task])
    suffix = "" if args.task == "mlp" else f"_{args.task}"
    out = args.out or HERE / f"population_results{suffix}.json"
    sweep = SMOKE_SWEEP if args.smoke else SWEEP
    record: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_average_start": load_average()}
    record.update(task=args.task, steps=steps, sweep=sweep, overrides=args.override)

    def write(results: dict[str, Any]) -> None:
        out.write_text(json.dumps({**record, **results}, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="xshard-population-") as work:
        runs = sweep_runs(sweep, args.override, args.smoke)
        results = measure(args.task, steps, Path(work), runs, write)
    record.update(load_average_end=load_average())
    write(results)


if __name__ == "__main__":
    main()
