"""An 8-trial learning rate x weight decay sweep of ``task=mlp``, Hydra's basic launcher
against ``hydra/launcher=population``, and one trial alone:
``python -m benchmarks.population [--task T] [--steps N] [--out PATH]`` ->
benchmarks/population_results.json (``--task tiny_gpt``: population_results_tiny_gpt.json).

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
from pathlib import Path
from typing import Any

from benchmarks.env import load_average

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
#: Training steps per job, by task.
STEPS = {"mlp": 50, "tiny_gpt": 20}
SWEEP = ["optimizer=adamw", "optimizer.learning_rate=1e-3,3e-3,1e-2,3e-2"]
SWEEP += ["optimizer.weight_decay=0,1e-2"]


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


def measure(task: str, steps: int, work: Path) -> dict[str, Any]:
    """One trial alone, the sweep with the basic launcher, the sweep as a population."""
    common = [f"trainer.steps={steps}", "trainer.progress=false", f"task={task}"]
    common.append("checkpoint=none")
    runs = {
        "one_trial": [*common, "optimizer=adamw", "optimizer.learning_rate=1e-3"],
        "basic": ["-m", *common, *SWEEP],
        "population": ["-m", "hydra/launcher=population", *common, *SWEEP],
    }
    out: dict[str, Any] = {}
    for name, args in runs.items():
        run = work / name
        key = "hydra.sweep.dir" if args[0] == "-m" else "hydra.run.dir"
        args = [*args, f"{key}={run}", f"trainer.compilation_cache_dir={work / f'cache_{name}'}"]
        out[name] = run_cli(args, run)
        print(name, out[name]["wall_s"], flush=True)
    basic, population = out["basic"]["jobs"], out["population"]["jobs"]
    out["final_loss_max_rel_diff"] = max(
        abs(basic[j]["final_loss"] - population[j]["final_loss"]) / abs(basic[j]["final_loss"])
        for j in basic
    )
    out["population_wall_over_one_trial"] = round(
        out["population"]["wall_s"] / out["one_trial"]["wall_s"], 2
    )
    out["basic_wall_over_one_trial"] = round(out["basic"]["wall_s"] / out["one_trial"]["wall_s"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    """Runs `measure` in a temporary dir and writes the JSON (``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.population")
    parser.add_argument("--task", choices=sorted(STEPS), default="mlp")
    parser.add_argument("--steps", type=int, help="training steps per job (default: by task)")
    parser.add_argument("--out", type=Path, help="default: population_results[_<task>].json")
    args = parser.parse_args(argv)
    steps = args.steps or STEPS[args.task]
    suffix = "" if args.task == "mlp" else f"_{args.task}"
    out = args.out or HERE / f"population_results{suffix}.json"
    record: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_average_start": load_average()}
    with tempfile.TemporaryDirectory(prefix="xshard-population-") as work:
        results = measure(args.task, steps, Path(work))
    record.update(load_average_end=load_average(), task=args.task, steps=steps, sweep=SWEEP)
    record.update(results)
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
