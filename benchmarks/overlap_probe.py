"""``python -m benchmarks.overlap_probe [--rate 10mbit]``: what XLA:CPU overlaps (issue 34 item 2).

Two processes of one CPU device each, joined over gloo in two network namespaces whose veth
pair tbf limits to ``--rate`` (`benchmarks.netns`), time four things, medians of ``--rounds``:

- ``collective``: a program that all-reduces ``--floats`` float32 over the two processes;
- ``compute``: a program of matmuls in a ``lax.fori_loop`` (no collective);
- ``dispatched``: the collective program dispatched, then the compute program, both waited
  for (JAX dispatches asynchronously: does XLA:CPU run the second while the first is in
  flight?);
- ``fused``: ONE program holding both, with no data dependency between them (does XLA:CPU's
  thunk executor run the compute while the all-reduce waits on the link?).

Overlap shows as a time near ``max(collective, compute)``; none as near their sum. Writes JSON
to ``--out`` (default ``benchmarks/overlap_probe_results.json``) and prints it. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.netns import ADDRESSES, emulated_link, unavailable

DEFAULT_OUT = Path(__file__).resolve().parent / "overlap_probe_results.json"
REPO = Path(__file__).resolve().parent.parent
PORT = 12455


def _worker(process: int, address: str, floats: int, size: int, loops: int, rounds: int) -> dict:
    """One process: joins, builds the programs, times them (process 0's numbers are kept)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=2, process_id=process)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())
    spread = NamedSharding(mesh, P("x"))

    def reduce(v):
        return jax.shard_map(
            lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")
        )(v)

    def compute(m):
        def body(_, a):
            return jnp.tanh(a @ a) * 0.5

        return jax.shard_map(
            lambda a: jax.lax.fori_loop(0, loops, body, a),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )(m)

    def both(v, m):
        return reduce(v), compute(m)

    local = lambda shape: jax.make_array_from_process_local_data(
        spread, np.full(shape, 0.01 * (process + 1), np.float32)
    )
    v, m = local((1, floats)), local((1, size, size))
    progs = {"collective": jax.jit(reduce), "compute": jax.jit(compute), "fused": jax.jit(both)}

    def dispatched():
        a = progs["collective"](v)
        b = progs["compute"](m)
        jax.block_until_ready((a, b))

    runs = {
        "collective": lambda: jax.block_until_ready(progs["collective"](v)),
        "compute": lambda: jax.block_until_ready(progs["compute"](m)),
        "dispatched": dispatched,
        "fused": lambda: jax.block_until_ready(progs["fused"](v, m)),
    }
    for fn in runs.values():  # compile and warm
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):  # interleaved: the load drifts
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    hlo = progs["fused"].lower(v, m).compile().as_text()
    return {
        "ms": {k: round(statistics.median(t) * 1e3, 2) for k, t in times.items()},
        "all_ms": {k: [round(x * 1e3, 1) for x in t] for k, t in times.items()},
        "fused_hlo_has_async_all_reduce": "all-reduce-start" in hlo,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the two processes on an emulated link and prints process 0's timings."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap_probe", description=__doc__)
    parser.add_argument("--rate", default="10mbit")
    parser.add_argument("--floats", type=int, default=64 * 1024, help="all-reduced floats")
    parser.add_argument("--size", type=int, default=192, help="matmul size")
    parser.add_argument("--loops", type=int, default=200, help="matmuls per compute program")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = (args.floats, args.size, args.loops, args.rounds)
    if args.worker is not None:
        out = _worker(args.worker, args.address, *shape)
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    why = unavailable()
    if why:
        print(f"benchmarks.overlap_probe: {why}", file=sys.stderr)
        return 2
    from benchmarks.env import environment, load_average

    meta = {**environment(), "load_average_start": load_average()}
    with emulated_link() as link, tempfile.TemporaryDirectory() as work:
        link.set_rate(args.rate)
        address = f"{ADDRESSES[0]}:{PORT + os.getpid() % 1000}"
        procs = []
        for i in range(2):
            argv = [*link.prefix(i), sys.executable, "-m", "benchmarks.overlap_probe"]
            argv += ["--worker", str(i), "--address", address, "--floats", str(args.floats)]
            argv += ["--size", str(args.size), "--loops", str(args.loops)]
            argv += ["--rounds", str(args.rounds)]
            log = Path(work, f"{i}.out").open("w+")
            procs.append((subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=log), log))
        for proc, _ in procs:
            proc.wait(timeout=600)
        text = Path(work, "0.out").read_text()
        for _, log in procs:
            log.close()
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if not lines:
        print(text[-3000:], file=sys.stderr)
        return 1
    meta["load_average_end"] = load_average()
    settings = {"rate": args.rate, "floats": args.floats, "size": args.size, "loops": args.loops}
    result: dict[str, Any] = {"meta": meta, "settings": settings, **json.loads(lines[0][7:])}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("settings", "ms")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
