"""Two processes x 4 CPU devices (gloo, coordinator on 127.0.0.1) train like one x 8 devices."""

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.multihost_reference import flat_params, train_mlp
from tests.multihost_worker import BATCH, PROCESSES, STEPS

REPO = Path(__file__).resolve().parents[1]


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
