"""Memory and step time of the 8x256 GPT for fp32, bf16 and bf16 + remat policies, side by side
in one process: ``python -m benchmarks.precision_memory`` -> benchmarks/precision_results.json.

Per variant: the compiled plain step's ``memory_analysis()`` (temporaries and arguments per
device), the live arrays per device after the steps, and the median of 5 step times. On the CPU
platform XLA computes bfloat16 dots in float32: the step times there say nothing of a GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.env import configure_devices

OUT = Path(__file__).resolve().parent / "precision_results.json"
VARIANTS = (
    ("fp32", "float32", "none"),
    ("bf16", "bfloat16", "none"),
    ("bf16+full", "bfloat16", "full"),
    ("bf16+dots_saveable", "bfloat16", "dots_saveable"),
)


def main() -> None:
    """Measures every variant of `VARIANTS` and writes `OUT`."""
    configure_devices()
    import jax
    import optax
    from jax.sharding import AxisType

    import xshard
    from trainers.core.precision import Precision
    from trainers.core.trainer import Trainer
    from trainers.tasks.tiny_gpt import TinyGPTTask

    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    out = {}
    for name, compute, remat in VARIANTS:
        task = TinyGPTTask(n_layers=8, d_model=256, d_ff=1024, n_heads=8, remat=remat)
        tx = xshard.cross_shard(optax.adam(1e-3), "mean")
        precision = Precision.of("float32", compute)
        trainer = Trainer(task, tx, mesh, global_batch_size=16, precision=precision)
        batches = iter(task.batches(16, seed=0))
        first = next(batches)
        state = trainer.init(*trainer.init_variables(first))
        state, metrics = trainer.step(state, first, with_stats=False)
        float(metrics["train/loss"])
        times = []
        for _ in range(5):
            start = time.perf_counter()
            state, metrics = trainer.step(state, next(batches), with_stats=False)
            float(metrics["train/loss"])
            times.append(time.perf_counter() - start)
        memory = trainer.compiled.memory_analysis()
        live = sum(x.nbytes for x in jax.live_arrays()) / mesh.size
        out[name] = {
            "temp_MiB": round(memory.temp_size_in_bytes / 2**20, 2),
            "arguments_MiB": round(memory.argument_size_in_bytes / 2**20, 2),
            "live_arrays_per_device_MiB": round(live / 2**20, 2),
            "median_step_s": round(sorted(times)[2], 3),
        }
        print(name, out[name], flush=True)
        del state
    OUT.write_text(json.dumps({"device": jax.devices()[0].device_kind, **out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
