"""Memory and step time of the 8x256 GPT for fp32, bf16 and bf16 + remat policies, side by side
in one process: ``python -m benchmarks.precision_memory [--quick] [--out PATH]`` ->
benchmarks/precision_results.json.

The GPT has 8 blocks of width 256 (d_ff 1024, 8 heads) and a sequence of 256 tokens, 2 rows
per device: long enough that the saved activations (the attention scores above all) outweigh
the optimizer state; at 64 tokens they do not, and every variant showed the same temporaries.
Per variant, of the trainer's real step program (`Trainer.lower`, the plain step):

- ``memory_analysis()`` per device: temporaries, arguments, outputs not aliased to a donated
  argument, and their sum (the compiled peak);
- on CPU, the temporaries as XLA:CPU compiles the step by default (``stock_cpu_temp_MiB``): it
  undoes remat (`trainers.tasks.remat`), so the program timed is compiled with
  `XLA_CPU_KEEP_REMAT`, as a GPU or TPU compiles it;
- the live arrays per device after the steps (the state and the batch) and, where the device
  reports it (GPU, TPU), its ``peak_bytes_in_use`` so far (``device_peak_so_far_MiB``: JAX
  never resets it, so a variant's own peak shows only where it exceeds the earlier ones');
- the median time of the timed steps, all variants in one process.

On the CPU platform XLA computes bfloat16 dots in float32 (with conversions around them): the
bf16 numbers there say nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.env import configure_devices

OUT = Path(__file__).resolve().parent / "precision_results.json"
#: The 8x256 GPT at 256 tokens, and a tiny one for ``--quick``.
GPT = dict(n_layers=8, d_model=256, d_ff=1024, n_heads=8, seq_len=256)
QUICK_GPT = dict(n_layers=2, d_model=32, d_ff=64, n_heads=2, seq_len=64, corpus_max_chars=20000)
ROWS_PER_DEVICE = 2
#: (name, compute dtype, trainer.remat).
VARIANTS = (
    ("fp32", "float32", "none"),
    ("bf16", "bfloat16", "none"),
    ("bf16+full", "bfloat16", "full"),
    ("bf16+dots_saveable", "bfloat16", "dots_saveable"),
    ("bf16+dots_with_no_batch_dims_saveable", "bfloat16", "dots_with_no_batch_dims_saveable"),
)
MiB = 2**20


def _mib(n: float | None) -> float | None:
    return None if n is None else round(n / MiB, 2)


def live_bytes_on(device: Any) -> int:
    """Bytes of the live arrays' shards on `device` (a replicated array counts whole)."""
    import jax

    total = 0
    for x in jax.live_arrays():
        if device in x.sharding.device_set:
            shape = x.sharding.shard_shape(x.shape)
            total += x.dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    return total


def measure(gpt: dict[str, Any], compute: str, remat: str, steps: int) -> dict[str, Any]:
    """One variant: its compiled step's memory, live arrays and median step time."""
    import jax
    import optax
    from jax.sharding import AxisType

    import xshard
    from trainers.core.precision import Precision
    from trainers.core.trainer import Trainer
    from trainers.tasks.remat import XLA_CPU_KEEP_REMAT
    from trainers.tasks.tiny_gpt import TinyGPTTask

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    batch = ROWS_PER_DEVICE * len(devices)
    task = TinyGPTTask(**gpt, remat=remat)
    tx = xshard.cross_shard(optax.adam(1e-3), "mean")
    precision = Precision.of("float32", compute)
    trainer = Trainer(task, tx, mesh, global_batch_size=batch, precision=precision)
    host = iter(task.batches(batch, seed=0))
    batches = (trainer.global_batch(b) for b in host)
    first = next(host)
    state = trainer.init(*trainer.init_variables(first))
    first = trainer.global_batch(first)
    lowered = trainer.lower(0, state, first)
    cpu = jax.default_backend() == "cpu"
    stock = lowered.compile().memory_analysis().temp_size_in_bytes if cpu else None
    step = lowered.compile(compiler_options=XLA_CPU_KEEP_REMAT if cpu else None)
    memory = step.memory_analysis()
    state, values = step(state, first)  # the first call, not timed
    jax.block_until_ready(values)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, values = step(state, next(batches))
        jax.block_until_ready(values)
        times.append(time.perf_counter() - start)
    live = live_bytes_on(devices[0])
    stats = devices[0].memory_stats() or {}
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    return {
        "temp_MiB": _mib(memory.temp_size_in_bytes),
        "arguments_MiB": _mib(memory.argument_size_in_bytes),
        "unaliased_outputs_MiB": _mib(outputs),
        "compiled_peak_MiB": _mib(
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + outputs
        ),
        "stock_cpu_temp_MiB": _mib(stock),
        "live_arrays_per_device_MiB": _mib(live),
        "device_peak_so_far_MiB": _mib(stats.get("peak_bytes_in_use")),
        "median_step_s": round(sorted(times)[len(times) // 2], 4),
    }


def main(argv: list[str] | None = None) -> None:
    """Measures every variant of `VARIANTS` and writes the JSON (``--out``, default `OUT`)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.precision_memory")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 timed steps")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    configure_devices()
    import jax

    gpt, steps = (QUICK_GPT, 2) if args.quick else (GPT, 3)
    devices = jax.devices()
    out: dict[str, Any] = {
        "device": f"{devices[0].device_kind} x {len(devices)}",
        "gpt": gpt,
        "global_batch": ROWS_PER_DEVICE * len(devices),
        "timed_steps": steps,
        "variants": {},
    }
    for name, compute, remat in VARIANTS:
        out["variants"][name] = measure(gpt, compute, remat, steps)
        print(name, out["variants"][name], flush=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
