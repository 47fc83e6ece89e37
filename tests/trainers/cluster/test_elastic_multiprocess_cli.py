"""Elastic replica groups of two ``jax.distributed`` processes each (slow, multiprocess): real
torchft, real JAX over gloo, real processes on 127.0.0.1, started by hand as a scheduler
would (a lighthouse, then each group's two processes with their own coordinator).

One run (a module fixture) of 2 groups of task=mlp on ``mesh=cpu4_group`` (its data axis of 4
devices spans the group's 2 processes; the elastic axis has size 1), DiLoCo every 8 steps:
process 1 of group 1 is killed (SIGKILL) among inner steps; group 1's process 0 exits in
bounded time with one line, group 0 goes on; group 1 is started again (both processes), rejoins
from group 0 (each process from the same rank of group 0), and after every sync both groups
dumped, the outer params are bitwise equal in every process of every group."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from tests.multihost_cli import PROCESSES, distributed, finish, free_port, start, tail
from trainers.exits import EXIT_PEER_LOST

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]

EVERY, STEPS, KILL_AFTER, HOLD_AT, HEARTBEAT_S = 8, 48, 16, 24, 5


class Run(NamedTuple):
    """The run's folders, the logs of each start and the exit statuses."""

    tmp: Path
    logs: dict[str, list[Path]]  # "g0", "g1", "g1.restart": one log per process
    codes: dict[str, list[int]]
    lost_after_s: float  # from the kill to the exit of group 1's other process


def overrides(tmp: Path, group: int, port: int, lighthouse: int) -> list[list[str]]:
    """Each process's overrides for `group` (its coordinator on `port`, the lighthouse on
    `lighthouse`): paced steps, the
    outer params dumped after every sync, group 0 held at `HOLD_AT` until the restarted
    group 1 waits in its first round (so that it rejoins from a live peer)."""
    joining = f"path:'{tmp}/g1.restart.p0.log',text:'Group 1 joining its peers',count:1"
    hooks = [
        "{_target_:tests.multihost_hooks.Pace,seconds:0.1}",
        f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{tmp}/dumps/g{group}',every:{EVERY}}}",
        f"{{_target_:tests.multihost_hooks.WaitForText,{joining},step:{HOLD_AT},timeout:400}}",
    ]
    common = [
        "task=mlp",
        "mesh=cpu4_group",
        "reduction=diloco_elastic",
        f"reduction.axes.slice.every_steps={EVERY}",
        f"reduction.axes.slice.elastic.group={group}",
        f"reduction.axes.slice.elastic.lighthouse=127.0.0.1:{lighthouse}",
        "reduction.axes.slice.elastic.heartbeat_s=0.1",
        "trainer.batch_size=16",
        f"trainer.steps={STEPS}",
        "trainer.progress=false",
        "checkpoint.enabled=false",
        f"distributed.heartbeat_timeout_s={HEARTBEAT_S}",
        "+allowed_targets=[tests.]",
        f"trainer.hooks=[{','.join(hooks)}]",
        f"hydra.run.dir={tmp}/group_{group}",
    ]
    return [[*common, *distributed(port, pid)] for pid in range(PROCESSES)]


def launch(
    tmp: Path, group: int, name: str, lighthouse: int
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Starts both processes of `group`, logs ``<tmp>/<name>.p<i>.log``."""
    logs = [tmp / f"{name}.p{pid}.log" for pid in range(PROCESSES)]
    return start(logs, overrides(tmp, group, free_port(), lighthouse)), logs


def wait_for(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    tmp, port = tmp_path_factory.mktemp("groups"), free_port()
    lighthouse = start(
        [tmp / "lighthouse.log"],
        [["lighthouse", "--bind", f"127.0.0.1:{port}", "--min-groups", "1",
          "--heartbeat-timeout-s", "3", "--join-timeout-s", "30"]],
        module="trainers.elastic",
    )[0]  # fmt: skip
    try:
        g0, logs0 = launch(tmp, 0, "g0", port)
        g1, logs1 = launch(tmp, 1, "g1", port)
        wait_for(tmp / "dumps" / "g1" / f"step{KILL_AFTER}.process1.npz")
        g1[1].send_signal(signal.SIGKILL)  # among its inner steps 17..24 (0.1 s each)
        killed = time.monotonic()
        first = finish(g1, logs1, timeout=HEARTBEAT_S + 60)
        lost_after_s = time.monotonic() - killed
        again, logs1r = launch(tmp, 1, "g1.restart", port)
        codes = {
            "g1": first,
            "g0": finish(g0, logs0, 600),
            "g1.restart": finish(again, logs1r, 300),
        }
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return Run(tmp, {"g0": logs0, "g1": logs1, "g1.restart": logs1r}, codes, lost_after_s)


def test_the_other_process_of_the_killed_group_exits_in_bounded_time_with_one_line(run):
    status, log = run.codes["g1"][0], run.logs["g1"][0]
    assert run.codes["g1"][1] == -signal.SIGKILL
    assert run.lost_after_s < HEARTBEAT_S + 20, tail(log)
    text = log.read_text()
    if status == -signal.SIGABRT:  # gloo noticed first, mid-collective (docs/multihost.md)
        assert "[enforce fail at external/gloo" in text, tail(log)
    else:
        assert status == EXIT_PEER_LOST, tail(log)
        lines = [ln for ln in text.splitlines() if ln.startswith("xshard: error:")]
        assert len(lines) == 1 and "Lost process 1" in lines[0], tail(log)


def test_group_0_goes_on_and_the_restarted_group_rejoins_in_every_process(run):
    for name in ("g0", "g1.restart"):
        for code, log in zip(run.codes[name], run.logs[name], strict=True):
            assert code == 0, f"{log.name} exited {code}:\n{tail(log)}"
            assert "Traceback" not in log.read_text(), tail(log)
    for log in run.logs["g0"]:
        text = log.read_text()
        assert text.count("Replica group 0 of") == 1 and "rejoined at step" not in text
    for log in run.logs["g1.restart"]:  # each process from the same rank of group 0
        assert "Group 1 rejoined at step" in log.read_text(), tail(log)


def test_the_outer_params_are_bitwise_equal_in_every_process_of_every_group(run):
    dumps = run.tmp / "dumps"

    def dump(group: int, pid: int, step: int) -> Path:
        return dumps / f"g{group}" / f"step{step}.process{pid}.npz"

    every = [(g, p) for g in (0, 1) for p in range(PROCESSES)]
    steps = range(EVERY, STEPS + 1, EVERY)
    both = [s for s in steps if all(dump(g, p, s).exists() for g, p in every)]
    assert {EVERY, KILL_AFTER, STEPS - EVERY, STEPS} <= set(both), both  # before, after
    before = None
    for step in both:
        first, *others = (np.load(dump(g, p, step)) for g, p in every)
        outer = sorted(k for k in first.files if k.startswith("outer_"))
        assert outer
        for other in [first, *others]:
            for k in outer:
                np.testing.assert_array_equal(first[k], other[k], err_msg=f"step {step} {k}")
                # every process restarted its replica from the outer params
                np.testing.assert_array_equal(other[f"replica_{k.split('_')[1]}"][0], other[k])
        if before is not None:
            assert not np.array_equal(before, first["outer_0"])  # the outer params moved
        before = first["outer_0"]
