"""``python -m benchmarks.dcn [--smoke] [--out PATH] [--rates ...]``: DiLoCo on a slow link.

The two slices of ``mesh=cpu2x4_slices`` run as two processes of 4 simulated CPU devices each,
joined over gloo, each in its own network namespace; the namespaces are joined by a veth pair
whose rate ``tc qdisc ... tbf`` limits on both ends (`benchmarks.netns`). Every run is the real
CLI (``python -m trainers.train``), ``distributed.coordinator_address`` on process 0's veth
address. Per link rate and reduction (`VARIANTS`):

- **time per step**: steady state, from process 0's TensorBoard ``perf/steps_per_sec`` (which
  excludes compile time), the first logging window left out; each window is one period of the
  slowest sync (``trainer.log_every`` = 32), so every window holds the same number of syncs;
- **utilisation**: compute time per step / time per step, where compute is the same two
  processes on an unlimited link with the slice axis not communicating (`COMPUTE`: ``local_sgd``
  whose period is longer than the run, so only the inner step runs, which reduces over ``data``
  within each process);
- **bytes per step over slice**: the trainer's logged ``comm/slice/bytes_per_step``.

Writes JSON to ``--out`` (default ``benchmarks/dcn_results.json``) and the Markdown table next
to it, and prints it. Needs root, ``ip`` and tbf (`benchmarks.netns.unavailable`). ``--smoke``:
one rate, two variants, few steps, no compute run (CI): its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.netns import ADDRESSES, Link, emulated_link, unavailable

DEFAULT_OUT = Path(__file__).resolve().parent / "dcn_results.json"
REPO = Path(__file__).resolve().parent.parent

#: The reductions compared, by name: their Hydra overrides.
VARIANTS: dict[str, tuple[str, ...]] = {
    "mean": ("reduction=mean",),
    "local_sgd H=8": ("reduction=local_sgd",),
    "diloco H=8": ("reduction=diloco",),
    "diloco H=32": ("reduction=diloco", "reduction.axes.slice.every_steps=32"),
    "diloco_int8 H=8": ("reduction=diloco_int8",),
    "diloco_int4 H=8": ("reduction=diloco_int8", "reduction.axes.slice.comm_dtype=int4"),
    # Streaming DiLoCo's fragments: a quarter of the params synced every 2 steps, each every 8.
    "diloco H=8 fragments=4": ("reduction=diloco", "reduction.axes.slice.fragments=4"),
    # Streaming DiLoCo's delay, as separate programs and as the one window program (overlap).
    "diloco H=8 tau=2": ("reduction=diloco", "reduction.axes.slice.sync_delay=2"),
    "diloco H=8 tau=2 overlap": (
        "reduction=diloco",
        "reduction.axes.slice.sync_delay=2",
        "reduction.axes.slice.overlap=true",
    ),
}
#: Every run: the task and mesh, nothing but training (no checkpoints, no per-layer stats).
BASE = (
    "mesh=cpu2x4_slices",
    "checkpoint.enabled=false",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    "trainer.progress=false",
    "distributed.enabled=true",
    "distributed.num_processes=2",
    "distributed.cpu_collectives=gloo",
)
PORT = 12355
STEPS_TAG, BYTES_TAG = "perf/steps_per_sec", "comm/slice/bytes_per_step"


class Settings(NamedTuple):
    """How much to run: rates (tc syntax), variants, task overrides, windows, window length."""

    rates: tuple[str, ...]
    variants: tuple[str, ...]
    task: tuple[str, ...]
    windows: int  # logging windows per run; the first is left out
    window: int  # steps per window (trainer.log_every)
    compute: bool  # whether to measure the compute-only run (utilisation)


FULL = Settings(("1gbit", "100mbit", "10mbit"), tuple(VARIANTS), ("task=mlp",), 8, 32, True)
SMOKE = Settings(("10mbit",), ("mean", "diloco H=8"), ("task=mlp",), 3, 8, False)


def compute_overrides(settings: Settings) -> tuple[str, ...]:
    """The compute-only run: local SGD whose first sync would come after the run ends."""
    steps = settings.windows * settings.window
    return ("reduction=local_sgd", f"reduction.axes.slice.every_steps={steps + 1}")


class Measured(NamedTuple):
    """One run's steady state: ms per step (the median of the kept windows: robust to another
    job's burst on the shared cores), each window's ms per step, the logged bytes per step over
    slice."""

    ms_per_step: float
    windows_ms: list[float]
    slice_bytes_per_step: float | None


def _scalars(tb_root: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = {p.parent for p in tb_root.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def read_run(run_dir: Path) -> Measured:
    """Process 0's steady state from its TensorBoard events: every window but the first."""
    speed = _scalars(run_dir / "tb", STEPS_TAG)
    kept = [1e3 / speed[step] for step in sorted(speed)[1:]]
    if not kept:
        raise RuntimeError(f"{run_dir}: fewer than two {STEPS_TAG} windows logged")
    logged = _scalars(run_dir / "tb", BYTES_TAG)
    return Measured(
        round(statistics.median(kept), 3),
        [round(ms, 3) for ms in kept],
        logged[max(logged)] if logged else None,
    )


def run_pair(link: Link, overrides: tuple[str, ...], run_dir: Path, port: int) -> Measured:
    """Trains one run as two processes, one in each namespace of `link`, and reads it back.

    Raises:
      RuntimeError: a process failed or both did not end within 10 minutes (both are killed;
        the message has the tail of each one's output).
    """
    address = f"{ADDRESSES[0]}:{port}"
    procs = []
    for i in range(2):
        argv = [*link.prefix(i), sys.executable, "-m", "trainers.train", *overrides]
        argv += [f"hydra.run.dir={run_dir}", f"distributed.coordinator_address={address}"]
        argv.append(f"distributed.process_id={i}")
        log = (run_dir.parent / f"{run_dir.name}.{i}.out").open("w")
        procs.append((subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log), log))
    failed = []
    try:
        for i, (proc, _) in enumerate(procs):
            if proc.wait(timeout=600) != 0:
                failed.append(i)
    except subprocess.TimeoutExpired:
        failed.append(-1)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        tails = [(run_dir.parent / f"{run_dir.name}.{i}.out").read_text()[-2000:] for i in range(2)]
        raise RuntimeError(f"{run_dir.name} failed ({failed}):\n" + "\n---\n".join(tails))
    return read_run(run_dir)


def measure(settings: Settings, work: Path) -> dict[str, Any]:
    """Every run of `settings` on one emulated link; the rate changes between runs. Before
    each rate's runs, the compute-only run (unlimited link), which that rate's utilisations
    divide: the load of other jobs on the shared cores drifts within the hour."""
    steps = settings.windows * settings.window
    common = (
        *BASE,
        *settings.task,
        f"trainer.steps={steps}",
        f"trainer.log_every={settings.window}",
    )
    out: dict[str, Any] = {"compute": {}, "rows": []}
    with emulated_link() as link:
        port = PORT
        for rate in settings.rates:
            base = None
            if settings.compute:
                port += 1
                link.set_rate(None)
                only = (*common, *compute_overrides(settings))
                compute = run_pair(link, only, work / f"compute-{rate}", port)
                print(f"[dcn] compute before {rate}: {compute}", file=sys.stderr, flush=True)
                out["compute"][rate] = compute._asdict()
                base = compute.ms_per_step
            link.set_rate(rate)
            for name in settings.variants:
                port += 1
                tag = f"{rate}-{name}".replace(" ", "_").replace("=", "")
                got = run_pair(link, (*common, *VARIANTS[name]), work / tag, port)
                print(f"[dcn] {rate} {name}: {got}", file=sys.stderr, flush=True)
                util = round(base / got.ms_per_step, 3) if base else None
                row = {"rate": rate, "variant": name, **got._asdict(), "utilisation": util}
                out["rows"].append(row)
    return out


def goal(results: dict[str, Any]) -> str:
    """The issue's goal line, as measured: at each rate where ``mean`` is at least 3x slower
    than compute alone, the best DiLoCo variant's utilisation (goal: >= 0.95)."""
    rows = results["rows"]
    slow = [r for r in rows if r["variant"] == "mean" and (r["utilisation"] or 1) <= 1 / 3]
    if not slow:
        return "No rate made `mean` 3x slower than compute alone: the goal does not apply."
    lines = []
    for mean in slow:
        rate = mean["rate"]
        diloco = [r for r in rows if r["rate"] == rate and r["variant"].startswith("diloco")]
        best = max(diloco, key=lambda r: r["utilisation"])
        verdict = "met" if best["utilisation"] >= 0.95 else "not met"
        lines.append(
            f"At {rate}, `mean` runs at {mean['utilisation']:.2f} of compute-bound throughput; "
            f"the best DiLoCo variant, `{best['variant']}`, at {best['utilisation']:.2f} "
            f"(goal >= 0.95: {verdict})."
        )
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    """The Markdown table of `results`, with the goal line and the compute run."""
    meta, compute = results["meta"], results["compute"]
    lines = [
        "# DiLoCo on an emulated slow link",
        "",
        f"`python -m benchmarks.dcn` ({meta['mode']}; commit {meta.get('git_commit')}, "
        f"{meta.get('date_utc')}, {meta.get('cpus_usable')} usable CPUs, load average "
        f"{meta.get('load_average_start')} at start, {meta.get('load_average_end')} at end). "
        "Two processes x 4 simulated CPU devices over gloo (`mesh=cpu2x4_slices`, one slice "
        "per process), each in a network namespace; the veth pair between them limited by tbf "
        f"on both ends. Task overrides: {' '.join(results['settings']['task'])}; "
        f"{results['settings']['windows']} windows of {results['settings']['window']} steps, "
        "the first left out. docs/benchmarks.md says how.",
        "",
    ]
    for rate, c in compute.items():
        lines.append(
            f"- compute alone before the {rate} runs (unlimited link, slice axis not "
            f"communicating): {c['ms_per_step']:.2f} ms/step (windows {c['windows_ms']})"
        )
    lines.append("")
    lines += [
        "| link rate | variant | ms / step (median) | utilisation | bytes / step over slice |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results["rows"]:
        util = f"{r['utilisation']:.2f}" if r["utilisation"] is not None else "-"
        sent = f"{r['slice_bytes_per_step']:,.0f}" if r["slice_bytes_per_step"] else "-"
        lines.append(f"| {r['rate']} | {r['variant']} | {r['ms_per_step']:.2f} | {util} | {sent} |")
    if compute:
        lines += ["", goal(results)]
    lines += [
        "",
        "Bytes are per device per step (process 0's logged `comm/slice/bytes_per_step`). The "
        "machine's 2 CPU cores are shared with other jobs and both processes: CPU-bound rows "
        "(the fast links, the periodic variants) move by tens of percent between runs; the "
        "link-bound rows (`mean` at the slow rates) are what this table measures.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measures, writes JSON and Markdown; exit 2 with one line where no link can be made."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dcn", description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="one rate, two variants, few steps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON path")
    parser.add_argument("--rates", nargs="+", help="tc rates (default: 1gbit 100mbit 10mbit)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all")
    args = parser.parse_args(argv)
    settings = SMOKE if args.smoke else FULL
    if args.rates:
        settings = settings._replace(rates=tuple(args.rates))
    if args.variants:
        settings = settings._replace(variants=tuple(args.variants))
    why = unavailable()
    if why:
        print(f"benchmarks.dcn: {why}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like SIGINT, so the namespaces are removed (`emulated_link`'s finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from benchmarks.env import environment, load_average

    meta = {**environment(), "mode": "smoke" if args.smoke else "full"}
    meta["load_average_start"] = load_average()
    with tempfile.TemporaryDirectory(prefix="xshard-dcn-") as work:
        results = {"meta": meta, "settings": settings._asdict(), **measure(settings, Path(work))}
    meta["load_average_end"] = load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    markdown = render(results)
    args.out.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
