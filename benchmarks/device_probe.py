"""What an accelerator does with xshard's step: ``python -m benchmarks.device_probe [--smoke]
[--out PATH]``, run by `benchmarks/device_check.sh`.

On every device of the default backend (one GPU, a TPU host, or 8 simulated CPU devices):

- the compiled bf16 step's dots are bfloat16 (XLA:CPU rewrites them to float32: there the
  lowered program's are checked), the fp32 step's float32;
- bf16 trains the GPT within 2% of fp32's losses at the same steps;
- ``grad_impl=gspmd`` with ZeRO-2 compiles a reduce-scatter (with more than one device);
- a checkpoint of the bf16 state saved (Orbax, the checkpoint hook) and restored on these
  devices is bitwise the saved state;
- tokens/s and MFU of the 8x256 GPT through the trainer, fp32 against bf16, with the device's
  peak FLOP/s (`PEAK_FLOPS`, dense bfloat16; the ``logger.peak_flops_per_device`` to give a
  run); `benchmarks.gpt_throughput` compares them with a hand-written step.

``--smoke``: a tiny GPT and a few steps, to check the probe works (the CPU dry run).
Writes JSON to ``--out`` (default: stdout).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.hlo import dot_operand_dtypes

#: Dense bfloat16 FLOP/s per device by device kind (vendor datasheets), for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v5e": 197e12}


def peak_flops(kind: str) -> float | None:
    """The peak of the first `PEAK_FLOPS` entry named in the device kind, or None."""
    return next((v for k, v in PEAK_FLOPS.items() if k.lower() in kind.lower()), None)


def _gpt(smoke: bool) -> Any:
    from trainers.tasks.tiny_gpt import TinyGPTTask

    if smoke:
        return TinyGPTTask(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)
    return TinyGPTTask(d_model=256, n_heads=8, n_layers=8, d_ff=1024, seq_len=64)


def _trainer(task, batch: int, compute: str = "float32", **kwargs: Any) -> tuple[Any, Any, Any]:
    import jax
    import optax
    from jax.sharding import AxisType

    import xshard
    from trainers.core.precision import Precision
    from trainers.core.trainer import Trainer

    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(AxisType.Auto,))
    tx = xshard.cross_shard(optax.adam(1e-3), "mean")
    precision = Precision.of("float32", compute)
    trainer = Trainer(task, tx, mesh, global_batch_size=batch, precision=precision, **kwargs)
    first = next(iter(task.batches(batch, seed=0)))
    return trainer, trainer.init(*trainer.init_variables(first)), first


#: What a matrix multiplication is in compiled HLO besides a ``dot``: on a GPU the cuBLAS /
#: cuBLASLt custom call or the Triton GEMM fusion XLA rewrites it to.
_GEMM = re.compile(r"__cublas\$|__triton_gemm|kind=kCustom, calls=%gemm_fusion")


def dot_dtypes(text: str) -> list[str]:
    """The dtypes of the matrix multiplications of a StableHLO or HLO text: a dot's operands'
    (`benchmarks.hlo.dot_operand_dtypes`: bfloat16 operands accumulated into float32 still
    compute in bfloat16), a GEMM custom call's or fusion's result (a custom call's result is a
    tuple: its first element)."""
    found = dot_operand_dtypes(text)
    for line in text.splitlines():
        if _GEMM.search(line):
            result = re.search(r"= \(?(\w+)\[", line)
            if result:
                found.add(result.group(1))
    return sorted(found)


def dots(smoke: bool, batch: int) -> dict[str, Any]:
    """The dtypes of the step's dots, lowered and compiled, for fp32 and bf16."""
    out = {}
    for compute in ("float32", "bfloat16"):
        trainer, state, first = _trainer(_gpt(smoke), batch, compute)
        lowered = trainer.lower(0, state, trainer.global_batch(first))
        out[compute] = {
            "lowered": dot_dtypes(lowered.as_text()),
            "compiled": dot_dtypes(lowered.compile().as_text()),
        }
    return out


def run_steps(compute: str, smoke: bool, batch: int, steps: int) -> dict[str, Any]:
    """Losses, step time, tokens/s and FLOPs of `steps` steps of the GPT in `compute`."""
    import jax

    task = _gpt(smoke)
    trainer, state, _ = _trainer(task, batch, compute)
    batches = iter(task.batches(batch, seed=0))
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        losses.append(float(metrics["train/loss"]))  # waits for the step
        times.append(time.perf_counter() - start)
    jax.block_until_ready(state)
    step_s = sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else times[0]
    cost = trainer.compiled.cost_analysis() if trainer.compiled is not None else None
    flops = (cost or {}).get("flops") if isinstance(cost, dict) else None
    memory = trainer.compiled.memory_analysis() if trainer.compiled is not None else None
    return {
        "losses": losses,
        "median_step_s": step_s,
        "tokens_per_s": batch * task.seq_len / step_s,
        "flops_per_step_per_device": flops,
        "temp_bytes_per_device": getattr(memory, "temp_size_in_bytes", None),
    }


def reduce_scatter(smoke: bool, batch: int) -> dict[str, Any]:
    """Whether ``grad_impl=gspmd`` with ZeRO-2 compiles a reduce-scatter on these devices."""
    import jax

    if len(jax.devices()) < 2:
        return {"checked": False, "why": "one device: nothing to scatter over"}
    trainer, state, first = _trainer(_gpt(smoke), batch, grad_impl="gspmd", zero_stage=2)
    text = trainer.lower(0, state, trainer.global_batch(first)).compile().as_text()
    # On a GPU, collectives are asynchronous: ``all-reduce-start(``, or the plain op inside
    # an ``async-start``'s computation.
    ops = ("reduce-scatter", "all-reduce", "all-gather")
    found = {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in ops}
    return {"checked": True, "reduce_scatter": found["reduce-scatter"] > 0, "collectives": found}


def checkpoint_round_trip(smoke: bool, batch: int) -> dict[str, Any]:
    """Saves the bf16 GPT's state after two steps with the checkpoint hook (Orbax) and restores
    it onto a fresh state's shardings: whether every leaf comes back bitwise equal, and on the
    devices the state was on."""
    import tempfile

    import jax
    import numpy as np

    from trainers.checkpoint.resume import RestoreSource, restore_checkpoint
    from trainers.checkpoint.save import CheckpointHook
    from trainers.config import CheckpointOptions

    task = _gpt(smoke)
    trainer, state, first = _trainer(task, batch, "bfloat16")
    for _ in range(2):
        state, _ = trainer.step(state, first, with_stats=False)
    saved = jax.device_get(state)
    _, fresh, _ = _trainer(task, batch, "bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        hook = CheckpointHook(Path(tmp), CheckpointOptions(async_save=False, keep=None), {})
        hook.save(2, state)
        hook.close()
        restored = restore_checkpoint(RestoreSource(Path(tmp)), fresh, {})
    pairs = zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored)))
    bitwise = all(
        a.dtype == b.dtype and a.tobytes() == b.tobytes()  # NaN statistics slots included
        for a, b in ((np.asarray(a), np.asarray(b)) for a, b in pairs)
    )
    platforms = {d.platform for x in jax.tree.leaves(restored) for d in x.sharding.device_set}
    return {
        "bitwise_equal": bitwise,
        "restored_on": sorted(platforms),
        "same_shardings": jax.tree.map(lambda x: x.sharding, restored)
        == jax.tree.map(lambda x: x.sharding, fresh),
    }


def bf16_runs(smoke: bool, batch: int, peak: float | None) -> dict[str, Any]:
    """`run_steps` in fp32 and bf16, their MFU, and how far bf16's losses are from fp32's."""
    steps = 4 if smoke else 30
    runs = {c: run_steps(c, smoke, batch, steps) for c in ("float32", "bfloat16")}
    for r in runs.values():
        flops = r["flops_per_step_per_device"]
        r["mfu"] = flops / r["median_step_s"] / peak if flops and peak else None
    fp32, bf16 = (runs[c]["losses"] for c in ("float32", "bfloat16"))
    worst = max(abs(a - b) / abs(b) for a, b in zip(bf16, fp32))
    within = worst <= 0.02
    return {"runs": runs, "bf16_vs_fp32_max_rel_loss_diff": worst, "bf16_within_2pct": within}


def probe(smoke: bool, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every check of the module docstring into one JSON-ready dict, handed to `write` after
    each check (what a time limit cuts short is still written); a check that raises is
    recorded as ``{"error": ...}`` and the others run."""
    import jax

    devices = jax.devices()
    batch = 8 * len(devices) if smoke else 16 * len(devices)
    kind = devices[0].device_kind
    peak = peak_flops(kind)
    record: dict[str, Any] = {
        "backend": jax.default_backend(),
        "device_kind": kind,
        "devices": len(devices),
        "peak_flops_per_device": peak,
    }
    checks: dict[str, Callable[[], Any]] = {
        "dots": lambda: dots(smoke, batch),
        "bf16": lambda: bf16_runs(smoke, batch, peak),
        "zero2_gspmd": lambda: reduce_scatter(smoke, batch),
        "checkpoint": lambda: checkpoint_round_trip(smoke, batch),
    }
    write(record)
    for name, check in checks.items():
        try:
            record[name] = check()
        except Exception as e:  # recorded; the other checks still run
            record[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        write(record)
    return record


def main(argv: list[str] | None = None) -> None:
    """Runs `probe`, writing its JSON to ``--out`` after each check (default: stdout at the
    end)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_probe")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT, a few steps")
    parser.add_argument("--out", default=None, help="JSON path (default: stdout)")
    args = parser.parse_args(argv)
    from benchmarks.env import configure_devices

    configure_devices()

    def write(record: dict[str, Any]) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")

    record = probe(args.smoke, write)
    if not args.out:
        print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
