"""Where the first asynchronous checkpoint's time goes: ``python -m benchmarks.checkpoint_stall``.

Trains tiny_gpt (the CLI's default task) on 8 simulated CPU devices with the CLI's optimizer and
a real `CheckpointHook` (async Orbax saves), and times what the step loop waits for at each
save: the on-device integrity check (`_integrity`, jitted: compiled at its first call unless
`CheckpointHook.prepare` compiled it at start-up), the size estimate, and the blocking part of
`CheckpointManager.save`. Prints one line per save, then the totals; docs/benchmarks.md has
the numbers.

    python -m benchmarks.checkpoint_stall   # without and with `prepare`, replica-parallel on/off
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _run(prepare: bool, replica_parallel: bool, saves: int = 3) -> list[dict[str, float]]:
    import dataclasses

    import jax

    from benchmarks.workloads import make_mesh, make_workload
    from trainers.checkpoint import save as checkpointing
    from trainers.checkpoint.save import CheckpointHook, CheckpointOptions
    from trainers.core.trainer import Trainer

    jax.clear_caches()
    wl = make_workload("tiny_gpt", smoke=False, num_batches=2)
    mesh = make_mesh(8)
    trainer = Trainer(
        wl.task,
        wl.xshard_optimizer(mesh),
        mesh,
        data_axes=("data",),
        global_batch_size=wl.global_batch_size,
    )
    state = trainer.init(trainer.init_params(wl.host_batches[0]))
    options = CheckpointOptions.from_config(wl.cfg.checkpoint)
    options = dataclasses.replace(options, replica_parallel=replica_parallel)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hook = CheckpointHook(tmp, options, {"task": "tiny_gpt"})
        start = time.perf_counter()
        if prepare:
            hook.prepare(state)
        prepare_s = time.perf_counter() - start
        for i in range(saves):
            state, _ = trainer.step(state, wl.host_batches[i % 2])
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            checkpointing.integrity(state)
            t1 = time.perf_counter()
            checkpointing.checkpoint_bytes(state)
            t2 = time.perf_counter()
            hook.last_saved = None  # time the hook's own save too (the integrity is cached now)
            hook.save(i + 1, state)
            t3 = time.perf_counter()
            rows.append(
                {
                    "save": i + 1,
                    "prepare_s": prepare_s if i == 0 else 0.0,
                    "integrity_s": t1 - t0,
                    "size_estimate_s": t2 - t1,
                    "hook_save_s": t3 - t2,
                }
            )
        hook.close()
    return rows


def main() -> None:
    """Prints the per-save times without and with `CheckpointHook.prepare`, and with Orbax's
    replica-parallel transfer on (its default) and off (``checkpoint.replica_parallel``'s
    default on one process)."""
    for prepare, replica_parallel in ((False, True), (True, True), (True, False)):
        print(f"prepare={prepare} replica_parallel={replica_parallel}")
        for row in _run(prepare, replica_parallel):
            print(
                "  "
                + ", ".join(f"{k}={v:.3f}" if k != "save" else f"{k}={v}" for k, v in row.items())
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
