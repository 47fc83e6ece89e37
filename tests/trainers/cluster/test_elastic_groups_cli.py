"""Elastic replica groups end to end (slow, multiprocess): real torchft, real JAX, real
processes on 127.0.0.1. One supervised run (``python -m trainers.elastic run --standby``) of 2
groups of task=mlp, DiLoCo every 8 steps, each group with a warm standby: group 1 is killed
(SIGKILL) in the middle of its inner steps once its standby is ready, group 0 goes on alone
without a restart, group 1's standby takes over and rejoins from group 0 (state and step);
then group 1's next standby is killed while it prepares, and group 1 is killed inside a sync's
allreduce (group 0 stopped in that round's quorum, so that group 1 waits in the collective for
it): group 0's round fails, is committed nowhere and is retried with the new quorum, and the
supervisor restarts group 1 (no live standby: a plain restart), which rejoins; after every
sync both groups dumped, their outer params are bitwise equal. Group 1's run dir holds one
history (its checkpoints, one TensorBoard run, its log) that no standby wrote to before its go,
resumed with no "changed config" line (the standby flag is no change of the run); every start
compiled its step programs and its elastic sync's before its join, a standby before its go."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.multihost_cli import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]  # ~2 min

EVERY, STEPS, KILL_AFTER, HOLD_AT, MID_SYNC = 8, 80, 16, 24, 48


def overrides(out: Path, dumps: Path) -> list[str]:
    """The groups' config: each dumps its outer params after every sync into its own folder,
    steps paced so that the kill lands among inner steps; group 0 held at `HOLD_AT` (and
    `MID_SYNC` + `EVERY`) until the restarted group 1 waits in its first quorum (so that it
    has a live peer to rejoin), and each group held before its sync at `MID_SYNC` (the hooks
    of a step run once the next is dispatched) until the
    test writes ``go`` to ``<dumps>/release_g<group>``; each group held after `KILL_AFTER`
    until its standby is ready (the first kill lands on a prepared standby)."""
    group = "${reduction.axes.slice.elastic.group}"

    def wait(path: str, text: str, count: int, step: int) -> str:
        return (
            f"{{_target_:tests.multihost_hooks.WaitForText,path:'{path}',text:'{text}',"
            f"count:{count},step:{step}}}"
        )

    joining = (f"{out}/group_1.log", "Group 1 joining its peers")
    hooks = [
        "{_target_:tests.multihost_hooks.Pace,seconds:0.1}",
        f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{group}',every:{EVERY}}}",
        wait(f"{out}/standby_{group}.log", "ready", 1, KILL_AFTER),
        wait(*joining, 2, HOLD_AT),
        wait(f"{dumps}/release_g{group}", "go", 1, MID_SYNC - 2),  # two steps in flight
        wait(*joining, 3, MID_SYNC + EVERY),
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
        f"checkpoint.every_steps={2 * EVERY}",
        "+allowed_targets=[tests.]",
        f"trainer.hooks=[{','.join(hooks)}]",
    ]


def wait_for(path: Path, text: str = "", timeout: float = 180.0) -> None:
    """Waits until `path` exists (and holds `text`)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or (text and text not in path.read_text()):
        assert time.monotonic() < deadline, f"{path} never appeared (with {text!r})"
        time.sleep(0.02)


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder`: its size and modification time."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def kill_with_a_ready_standby(out: Path) -> str:
    """Group 1 stopped once its standby is ready, its run dir unchanged while it is stopped
    (the standby, prepared and waiting, writes nothing there), then killed; returns the
    standby's process id."""
    wait_for(out / "standby_1.log", "Standby of group 1 ready")
    standby = (out / "standby_1.pid").read_text()
    pid = int((out / "group_1.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    before = tree(out / "group_1")
    time.sleep(0.5)
    assert tree(out / "group_1") == before
    os.kill(pid, signal.SIGKILL)  # among its inner steps 17..24 (0.1 s each)
    return standby


def kill_the_next_standby(out: Path, first: str) -> None:
    """Once the `first` standby took over, the one started after it killed (SIGKILL) while it
    prepares: group 1's next death is a plain restart."""
    wait_for(out / "group_1.pid", first)  # the supervisor gave the group to the standby
    deadline = time.monotonic() + 180
    while (out / "standby_1.pid").read_text() in (first, ""):  # "": being written
        assert time.monotonic() < deadline, "no second standby"
        time.sleep(0.02)
    os.kill(int((out / "standby_1.pid").read_text()), signal.SIGKILL)


def kill_inside_the_allreduce(out: Path, dumps: Path) -> None:
    """Group 1 killed inside its sync at `MID_SYNC`: group 0 enters that sync first (group 1
    held) and is stopped once its quorum request is out; group 1 is let go, gets the quorum
    of both (group 0's heartbeats stopped for less than the lighthouse's timeout) and waits
    in the allreduce for group 0's part; then group 1 is killed and group 0 continued."""
    entered = f"Sync at step {MID_SYNC}: exchanging"
    wait_for(out / "group_0.log", entered)
    time.sleep(0.5)  # its quorum request reaches the lighthouse; group 1 is held
    survivor = int((out / "group_0.pid").read_text())
    os.kill(survivor, signal.SIGSTOP)
    try:
        (dumps / "release_g1").write_text("go")
        wait_for(out / "group_1.log", entered)
        time.sleep(0.5)  # the quorum of both formed: group 1 in the allreduce
        os.kill(int((out / "group_1.pid").read_text()), signal.SIGKILL)
    finally:
        os.kill(survivor, signal.SIGCONT)


def test_a_killed_group_rejoins_from_a_live_peer_and_the_outer_params_stay_equal(tmp_path):
    out, dumps = tmp_path / "groups", tmp_path / "dumps"
    command = [
        sys.executable, "-m", "trainers.elastic", "run", "--groups", "2", "--out", str(out),
        "--bind", f"127.0.0.1:{free_port()}", "--min-groups", "1", "--heartbeat-timeout-s", "3",
        "--join-timeout-s", "30", "--restarts", "2", "--standby", "--", *overrides(out, dumps),
    ]  # fmt: skip
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    dumps.mkdir()
    (dumps / "release_g0").write_text("go")
    with subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) as sup:
        wait_for(dumps / "g1" / f"step{KILL_AFTER}.process0.npz")  # group 1 synced at 16
        kill_the_next_standby(out, kill_with_a_ready_standby(out))
        kill_inside_the_allreduce(out, dumps)
        _, err = sup.communicate(timeout=400)
    logs = {g: (out / f"group_{g}.log").read_text() for g in (0, 1)}
    assert sup.returncode == 0, err[-3000:] + logs[1][-3000:]
    assert err.count("Group 1 exited -9; its standby took over (pid") == 1, err[-3000:]
    assert err.count("Group 1 exited -9; restarting it (2)") == 1, err[-3000:]
    assert err.count("restarting it") == 1 and "Group 0 exited" not in err
    # group 0's standby never went: stopped at the end (its stdin closed), it wrote nothing
    assert (
        "Standby of group 0: its supervisor is gone or stopped it"
        in (out / "standby_0.log").read_text()
    )
    assert logs[0].count("Replica group 0 of") == 1  # group 0 was never restarted
    assert logs[1].count("Replica group 1 of") == 3
    assert logs[1].count("Group 1 rejoined at step") == 2  # from group 0's state, twice
    assert "Traceback" not in logs[0] + logs[1]
    # the standby resumed group 1's checkpoint and the restart the standby's: the same run
    assert "with a changed config" not in logs[1]
    check_the_starts(out, logs)
    check_one_history(out, logs[1])
    # the round group 1 died in failed in group 0, was committed nowhere and was retried
    mid = logs[0].split(f"Sync at step {MID_SYNC}: exchanging")[1]
    mid = mid.split(f"Sync at step {MID_SYNC} committed")[0]
    assert "Group 0: sync not committed (attempt 1 of 4)" in mid, mid
    assert f"Sync at step {MID_SYNC} committed" not in logs[1]
    both = [
        step
        for step in range(EVERY, STEPS + 1, EVERY)
        if all((dumps / f"g{g}" / f"step{step}.process0.npz").exists() for g in (0, 1))
    ]
    # after the first rejoin (at HOLD_AT + EVERY) and the second (at MID_SYNC + 2 * EVERY)
    assert {KILL_AFTER, HOLD_AT + 2 * EVERY, STEPS - EVERY, STEPS} <= set(both), both
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


def check_the_starts(out: Path, logs: dict[int, str]) -> None:
    """Each fresh start (group 0's, group 1's first and its plain restart) compiled its steps
    and its elastic sync's programs before it joined (its peers do not wait for that at
    their next sync) and not again after; the standby compiled both before it was ready and,
    once it took over, nothing."""
    starts = logs[1].split("Replica group 1 of")
    assert len(starts) == 4 and "Standby of group 1 taking over its group" in starts[1]
    compiled = ("Compiled the train step", "Compiled the elastic sync's programs")
    for start in [logs[0].split("Replica group 0 of")[1], starts[1], starts[3]]:
        before, joined, after = start.partition("joining its peers")
        assert joined and all(c in before for c in compiled), start[:3000]
        assert not any(c in after for c in compiled), after[:3000]
    assert not any(c in starts[2] for c in compiled), starts[2][:3000]
    standby = (out / "standby_1.log").read_text().split("Standby of group 1 ready")[0]
    assert all(c in standby for c in compiled)


def check_one_history(out: Path, log: str) -> None:
    """Group 1's run dir after its standby took over and a plain restart: the restart restored
    a checkpoint the standby wrote, the checkpoints reach the last step, one TensorBoard run
    whose loss reaches the last step, the log file there holds no standby's lines from before
    its go (those are in ``standby_1/``), and Hydra's config dump is the group's own."""
    from tests.cli import scalars
    from trainers.checkpoint.resume import complete_steps

    run_dir = out / "group_1"
    restart = log.split("Replica group 1 of")[3].split("Group 1 joining its peers")[0]
    checkpoints = re.escape(f"{run_dir}/checkpoints/")
    restored = re.search(rf"Restored step (\d+) from {checkpoints}", restart)
    assert restored and int(restored.group(1)) > KILL_AFTER, restart[-3000:]  # the standby's
    assert STEPS in complete_steps(run_dir / "checkpoints")
    assert max(scalars(run_dir / "tb", "train/loss")) == STEPS
    train_log = (run_dir / "train.log").read_text()
    assert train_log.count("Standby of group 1 taking over") == 1
    assert "Standby of group 1 ready" not in train_log
    assert "Standby of group 1 ready" in (out / "standby_1" / "train.log").read_text()
    assert "elastic.standby" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
