"""Tokens/s and MFU of xshard's step against a hand-written ``jax.jit`` step, fp32 and bf16, on
the devices at hand: ``python -m benchmarks.gpt_throughput [--quick] [--models a,b]
[--out PATH]``; run by `benchmarks/device_check.sh` on a GPU.

Models (`MODELS`): the 8x256 GPT (8 blocks of width 256, 256 tokens) and a larger one meant
to fill an 80 GB accelerator (24 blocks of width 1024, 1024 tokens, about 300M params; its
fp32 activations take most of the memory). Per model and compute dtype (float32 master params
in both), two steps on the same batches, in one process:

- ``xshard``: `Trainer.step` without statistics (the CLI's plain step);
- ``jit``: `benchmarks.baselines.jit_step` (MaxText style: plain ``jax.jit``, GSPMD),
  its loss given the params cast to the compute dtype as the trainer casts them.

Each records the median seconds per step over blocks of `BLOCK` steps (waiting once per
block), tokens/s, and MFU: model FLOPs (6 x params x tokens + 12 x layers x width x seq x
tokens, the PaLM count; the hand-written and the xshard step do the same model work) per
second over the device's dense bfloat16 peak (`benchmarks.device_probe.PEAK_FLOPS`, also for
fp32: the MFU of fp32 says how much of the bf16 peak fp32 reaches). A model or step that fails
(out of memory) is recorded with its error; the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import types
from pathlib import Path
from typing import Any

#: Model name -> (TinyGPTTask arguments, rows per device).
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "gpt_8x256": (dict(n_layers=8, d_model=256, d_ff=1024, n_heads=8, seq_len=256), 32),
    "gpt_24x1024": (dict(n_layers=24, d_model=1024, d_ff=4096, n_heads=16, seq_len=1024), 8),
}
QUICK_MODEL = (dict(n_layers=1, d_model=32, d_ff=64, n_heads=2, seq_len=16), 2)
BLOCK = 5


def model_flops_per_token(task: Any) -> float:
    """Training FLOPs per token: 6 x (non-embedding + embedding) params + attention's
    12 x layers x width x sequence (PaLM, appendix B)."""
    d, ff, layers = task.d_model, task.d_ff, task.n_layers
    params = layers * (4 * d * d + 2 * d * ff) + task.vocab_size * d
    return 6.0 * params + 12.0 * layers * d * task.seq_len


def _median_step_s(run_block: Any, blocks: int) -> float:
    """Median over `blocks` of the seconds per step of ``run_block()`` (`BLOCK` steps)."""
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        run_block()
        times.append((time.perf_counter() - start) / BLOCK)
    return sorted(times)[len(times) // 2]


def _bound_in_flight(state: Any) -> None:
    """On CPU, waits for each step (XLA:CPU's collectives deadlock with many in flight); an
    accelerator queues a block's steps."""
    import jax

    if jax.default_backend() == "cpu":
        jax.block_until_ready(state)


def xshard_step(task: Any, mesh: Any, batch: int, compute: str, batches: list) -> Any:
    """A ``run_block`` of `Trainer.step` (no statistics), compiled and warmed up."""
    import jax
    import optax

    import xshard
    from trainers.core.precision import Precision
    from trainers.core.trainer import Trainer

    tx = xshard.cross_shard(optax.adam(1e-4), "mean")
    precision = Precision.of("float32", compute)
    trainer = Trainer(task, tx, mesh, global_batch_size=batch, precision=precision)
    placed = [trainer.global_batch(b) for b in batches]
    state = [trainer.init(*trainer.init_variables(batches[0]))]

    def run_block() -> None:
        for i in range(BLOCK):
            state[0], _ = trainer.step(state[0], placed[i % len(placed)], with_stats=False)
            _bound_in_flight(state[0])
        jax.block_until_ready(state[0])

    run_block()  # compiles and warms up
    return run_block


def jit_step(task: Any, mesh: Any, compute: str, batches: list) -> Any:
    """A ``run_block`` of the hand-written `benchmarks.baselines.jit_step`, warmed up."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import baselines
    from trainers.core.precision import cast_floating

    opt = optax.adam(1e-4)
    cast = types.SimpleNamespace(loss=lambda p, b, r: task.loss(cast_floating(p, compute), b, r))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(task.init(jax.random.key(0), batches[0]), replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    shardings = jax.tree.map(lambda _: replicated, (params, opt_state))
    fn = baselines.jit_step(cast, opt, shardings, split)
    placed = [jax.device_put(b, split) for b in batches]
    state = [(params, opt_state)]

    def run_block() -> None:
        for i in range(BLOCK):
            p, o, _ = fn(*state[0], placed[i % len(placed)])
            state[0] = (p, o)
            _bound_in_flight(state[0])
        jax.block_until_ready(state[0])

    run_block()
    return run_block


def measure(name: str, gpt: dict[str, Any], rows: int, blocks: int) -> dict[str, Any]:
    """Both steps of one model in fp32 and bf16 (module docstring); errors recorded."""
    import jax
    from jax.sharding import AxisType

    from benchmarks.device_probe import peak_flops
    from trainers.tasks.tiny_gpt import TinyGPTTask

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))
    batch = rows * len(devices)
    task = TinyGPTTask(**gpt)
    host = iter(task.batches(batch, seed=0))
    batches = [next(host) for _ in range(2)]
    flops = model_flops_per_token(task)
    peak = peak_flops(devices[0].device_kind)
    out: dict[str, Any] = {"model": gpt, "global_batch": batch, "flops_per_token": flops}
    for compute in ("float32", "bfloat16"):
        for kind in ("xshard", "jit"):
            key = f"{compute}/{kind}"
            run = None
            try:
                if kind == "xshard":
                    run = xshard_step(task, mesh, batch, compute, batches)
                else:
                    run = jit_step(task, mesh, compute, batches)
                step_s = _median_step_s(run, blocks)
            except Exception as e:  # out of memory, a failed compile: recorded, not fatal
                out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            else:
                tokens = batch * task.seq_len / step_s
                out[key] = {
                    "step_s": round(step_s, 5),
                    "tokens_per_s": round(tokens, 1),
                    "mfu": None if peak is None else round(tokens * flops / len(devices) / peak, 4),
                }
            run = None  # frees the step's state before the next one allocates its own
            gc.collect()
            print(name, key, out[key], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """Measures the models and writes the JSON (``--out``, default: stdout)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpt_throughput")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 blocks")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--blocks", type=int, default=3, help="timed blocks per step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from benchmarks.env import configure_devices

    configure_devices()
    import jax

    from benchmarks.device_probe import peak_flops

    kind = jax.devices()[0].device_kind
    record: dict[str, Any] = {
        "device": f"{kind} x {len(jax.devices())}",
        "peak_flops_per_device": peak_flops(kind),
        "block_steps": BLOCK,
        "models": {},
    }
    names = args.models.split(",")
    chosen = {"quick": QUICK_MODEL} if args.quick else {m: MODELS[m] for m in names}
    for name, (gpt, rows) in chosen.items():
        record["models"][name] = measure(name, gpt, rows, 2 if args.quick else args.blocks)
        if args.out:  # what is measured so far survives a stage time limit
            args.out.write_text(json.dumps(record, indent=2) + "\n")
    if not args.out:
        print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
