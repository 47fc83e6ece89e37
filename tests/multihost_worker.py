"""One process of a two-process run: `python -m tests.multihost_worker PID PORT OUT`.

Two of these, each with 4 simulated CPU devices, join through a coordinator on 127.0.0.1 and
gloo collectives into one 8-device mesh (docs/development.md: multi-host runs), train
task=mlp with the Trainer, and write their final loss and params to OUT (.npz).
"""

import sys

import jax

PROCESSES, DEVICES_PER_PROCESS, STEPS, BATCH = 2, 4, 12, 32


def run(pid: int, port: int, out: str) -> None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=PROCESSES, process_id=pid)

    import numpy as np
    from jax.experimental import multihost_utils

    from tests.multihost_reference import flat_params, train_mlp

    loss, params = train_mlp(STEPS, BATCH)
    params = multihost_utils.process_allgather(params, tiled=True)  # replicated: any copy
    devices, processes = len(jax.devices()), jax.process_count()
    np.savez(out, loss=loss, devices=devices, processes=processes, **flat_params(params))


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
