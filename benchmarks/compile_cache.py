"""Compile time of the default training job and of a 4-job sweep, cold and warm cache:
``python -m benchmarks.compile_cache [--steps N] [--out PATH]`` ->
benchmarks/compile_cache_results.json.

Each run is a CLI process (``python -m trainers.train``, the job of ``make train`` with
``trainer.steps`` cut to `STEPS`), in this order: the single job with an empty
``trainer.compilation_cache_dir``, then again with the same dir (warm); the multirun sweep
``-m optimizer.learning_rate=`` four values with another empty dir, then again (warm). Per job
it records what its ``result.json`` says (``compile_time_s``: the train steps' compiling;
the programs read from the cache and compiled), and per process the wall time.
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
OUT = Path(__file__).resolve().parent / "compile_cache_results.json"
#: Training steps per job: the programs are the default run's, the training short.
STEPS = 20
#: The sweep's learning rates (4 jobs).
LEARNING_RATES = "1e-3,2e-3,3e-3,5e-3"


def run_cli(overrides: list[str], out_dir: Path, timeout: float = 900) -> dict[str, Any]:
    """One CLI process; its wall time and every ``result.json`` under `out_dir` (one per job,
    in job order)."""
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
    jobs = []
    for path in sorted(out_dir.rglob("result.json"), key=lambda p: str(p.parent)):
        record = json.loads(path.read_text())
        jobs.append(
            {
                "compile_time_s": record["compile_time_s"],
                "cache_hits": record["compilation_cache_hits"],
                "cache_misses": record["compilation_cache_misses"],
            }
        )
    total = sum(j["compile_time_s"] or 0.0 for j in jobs)
    return {"wall_s": round(wall, 2), "compile_time_s_total": round(total, 2), "jobs": jobs}


def measure(steps: int, work: Path) -> dict[str, Any]:
    """The four measurements of the module docstring, in its order."""
    common = [f"trainer.steps={steps}", "trainer.progress=false"]
    out: dict[str, Any] = {}
    for kind in ("train", "sweep"):
        cache = work / f"cache_{kind}"
        for temperature in ("cold", "warm"):
            run = work / f"{kind}_{temperature}"
            if kind == "train":
                args = [*common, f"hydra.run.dir={run}"]
            else:
                args = ["-m", f"optimizer.learning_rate={LEARNING_RATES}", *common]
                args.append(f"hydra.sweep.dir={run}")
            args.append(f"trainer.compilation_cache_dir={cache}")
            out[f"{kind}_{temperature}"] = run_cli(args, run)
            print(kind, temperature, out[f"{kind}_{temperature}"], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Runs `measure` in a temporary dir and writes the JSON (``--out``, default `OUT`)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compile_cache")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per job")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_average_start": load_average()}
    with tempfile.TemporaryDirectory(prefix="xshard-compile-cache-") as work:
        results = measure(args.steps, Path(work))
    record.update(load_average_end=load_average(), steps=args.steps, sweep=LEARNING_RATES)
    record.update(results)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
