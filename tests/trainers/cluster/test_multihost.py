"""Two processes x 4 CPU devices (gloo, coordinator on 127.0.0.1) train like one x 8 devices."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import REPO
from tests.cli import ONE_PATH, run_train, scalars
from tests.multihost_reference import flat_params, train_mlp
from tests.multihost_worker import BATCH, PROCESSES, STEPS
from trainers.checkpoint.io import complete_steps

pytestmark = [pytest.mark.long, pytest.mark.multiprocess]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_the_same_devices(tmp_path):
    port = _free_port()
    outs = [tmp_path / f"p{pid}.npz" for pid in range(PROCESSES)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multihost_worker", str(pid), str(port), str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid, out in enumerate(outs)
    ]
    for proc in procs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-4000:]

    loss, params = train_mlp(STEPS, BATCH)  # this process: 8 devices (conftest.py)
    expected = flat_params(params)
    for out in outs:
        got = np.load(out)
        assert int(got["devices"]) == 8 and int(got["processes"]) == PROCESSES
        np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_cli_on_two_processes_with_their_own_run_dirs_checkpoints_once_and_matches_one_process(
    tmp_path,
):
    # Each process its own hydra.run.dir (what Hydra's timestamped default gives hosts started
    # a second apart): they save into process 0's checkpoint dir, and only it writes events.
    common = [ONE_PATH, "task=mlp", "mesh=auto", "trainer.steps=6", "trainer.log_every=1"]
    port = _free_port()
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "4"}  # mesh=auto: 4 devices per process
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainers.train",
                *common,
                "trainer.progress=false",
                "distributed.enabled=true",
                f"distributed.coordinator_address=127.0.0.1:{port}",
                f"distributed.num_processes={PROCESSES}",
                f"distributed.process_id={pid}",
                "distributed.cpu_collectives=gloo",
                f"hydra.run.dir={tmp_path / f'p{pid}'}",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(PROCESSES)
    ]
    for proc in procs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-4000:]
    assert not (tmp_path / "p1" / "tb").exists()  # only process 0 writes TensorBoard events
    assert complete_steps(tmp_path / "p0" / "checkpoints") == [6]
    assert not (tmp_path / "p1" / "checkpoints").exists()

    single = f"hydra.run.dir={tmp_path / 'single'}"
    run_train(*common, "checkpoint=none", single, cwd=tmp_path)  # 8 devices
    two = scalars(tmp_path / "p0" / "tb", "train/loss")
    one = scalars(tmp_path / "single" / "tb", "train/loss")
    assert sorted(two) == sorted(one) == list(range(1, 7))
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-5)
