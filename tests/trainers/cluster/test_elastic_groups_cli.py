"""Elastic replica groups end to end (slow, multiprocess): real torchft, real JAX, real
processes on 127.0.0.1. One supervised run (``python -m trainers.elastic run``) of 2 groups of
task=mlp, DiLoCo every 8 steps: group 1 is killed (SIGKILL) in the middle of its inner steps,
group 0 goes on alone without a restart, the supervisor restarts group 1, which rejoins from
group 0 (state and step); after every sync both groups dumped, their outer params are
bitwise equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.multihost_cli import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]  # ~1.5-2 min

EVERY, STEPS, KILL_AFTER, HOLD_AT = 8, 64, 16, 32


def overrides(out: Path, dumps: Path) -> list[str]:
    """The groups' config: each dumps its outer params after every sync into its own folder,
    steps paced so that the kill lands among inner steps, and group 0 held at `HOLD_AT` until
    the restarted group 1 waits in its first quorum (so that it has a live peer to rejoin)."""
    group = "${reduction.axes.slice.elastic.group}"
    hooks = [
        "{_target_:tests.multihost_hooks.Pace,seconds:0.1}",
        f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{group}',every:{EVERY}}}",
        f"{{_target_:tests.multihost_hooks.WaitForText,path:'{out}/group_1.log',"
        f"text:'Group 1 joining its peers',count:2,step:{HOLD_AT}}}",
    ]
    return [
        "task=mlp",
        "mesh=cpu4_group",
        "reduction=diloco_elastic",
        f"reduction.axes.slice.every_steps={EVERY}",
        "reduction.axes.slice.elastic.heartbeat_s=0.1",
        "trainer.batch_size=16",
        f"trainer.steps={STEPS}",
        "trainer.progress=false",
        "checkpoint.enabled=false",
        "+allowed_targets=[tests.]",
        f"trainer.hooks=[{','.join(hooks)}]",
    ]


def wait_for(path: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_killed_group_rejoins_from_a_live_peer_and_the_outer_params_stay_equal(tmp_path):
    out, dumps = tmp_path / "groups", tmp_path / "dumps"
    command = [
        sys.executable, "-m", "trainers.elastic", "run", "--groups", "2", "--out", str(out),
        "--bind", f"127.0.0.1:{free_port()}", "--min-groups", "1", "--heartbeat-timeout-s", "1",
        "--join-timeout-s", "30", "--restarts", "1", "--", *overrides(out, dumps),
    ]  # fmt: skip
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    with subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) as sup:
        wait_for(dumps / "g1" / f"step{KILL_AFTER}.process0.npz")  # group 1 synced at 16
        first = int((out / "group_1.pid").read_text())
        os.kill(first, signal.SIGKILL)  # among its inner steps 17..24 (0.1 s each)
        _, err = sup.communicate(timeout=400)
    logs = {g: (out / f"group_{g}.log").read_text() for g in (0, 1)}
    assert sup.returncode == 0, err[-3000:] + logs[1][-3000:]
    assert "Group 1 exited -9; restarting it (1)" in err
    assert "restarting it" not in err.replace("Group 1 exited -9; restarting it (1)", "")
    assert logs[0].count("Replica group 0 of") == 1  # group 0 was never restarted
    assert logs[1].count("Replica group 1 of") == 2
    assert "Group 1 rejoined at step" in logs[1]  # from group 0's state
    assert "Traceback" not in logs[0] + logs[1]
    both = [
        step
        for step in range(EVERY, STEPS + 1, EVERY)
        if all((dumps / f"g{g}" / f"step{step}.process0.npz").exists() for g in (0, 1))
    ]
    assert KILL_AFTER in both and STEPS in both and max(both) > HOLD_AT, both
    before = None
    for step in both:
        g0, g1 = (np.load(dumps / f"g{g}" / f"step{step}.process0.npz") for g in (0, 1))
        outer = sorted(k for k in g0.files if k.startswith("outer_"))
        assert outer and sorted(g1.files) == sorted(g0.files)
        for k in outer:
            np.testing.assert_array_equal(g0[k], g1[k], err_msg=f"step {step} {k}")
            for g in (g0, g1):  # each group restarted its replica from the outer params
                np.testing.assert_array_equal(g[f"replica_{k.split('_')[1]}"][0], g[k])
        if before is not None:
            assert not np.array_equal(before, g0["outer_0"])  # the outer params moved
        before = g0["outer_0"]
