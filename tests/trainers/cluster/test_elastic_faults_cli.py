"""Faults of elastic replica groups (slow, multiprocess): real torchft, real JAX, each group its
own ``python -m trainers.train`` on 127.0.0.1 around one lighthouse (``python -m
trainers.elastic lighthouse``, a fixture of this module, or one of the test's own). A group
that joins with another config, or with an id another group has, is refused with one line
(exit 2) and the group that was there logs the same line and trains to its end; a SIGSTOP'd
group is dropped, and SIGCONT'd is refused (exit 4, one line); the groups go on after the
lighthouse is killed and restarted; a group waiting in its quorum leaves it on SIGTERM (exit
75, its checkpoint from before the sync) and, restarted after the others are gone, resumes
from its own checkpoint alone. docs/reliability.md has the table of these faults. ~6 min in
all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import REPO
from tests.multihost_cli import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]

EVERY, HOLD_AT = 8, 16
KEY = "reduction.axes.slice.elastic"
ENV = {**os.environ, "HYDRA_FULL_ERROR": "0"}
#: torchft retries a quorum the lighthouse did not answer every quorum_timeout_s /
#: (quorum_retries + 1) seconds: 60 / 31, not the default's 600 / 31 (19.4 s)
RETRY_EVERY_2S = f"{KEY}.quorum_timeout_s=60"


@pytest.fixture(scope="module")
def lighthouse() -> Iterator[str]:
    """A lighthouse on 127.0.0.1 that drops a silent group after 1 s; its ``host:port``."""
    bind = f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "trainers.elastic", "lighthouse", "--bind", bind,
        "--min-groups", "1", "--heartbeat-timeout-s", "1", "--join-timeout-s", "20",
    ]  # fmt: skip
    with subprocess.Popen(command, cwd=REPO, env=ENV, stderr=subprocess.PIPE, text=True) as proc:
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield bind
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def group(lighthouse: str, gid: int, run_dir: Path, *extra: str) -> list[str]:
    """The command of group `gid`: task=mlp, a sync every `EVERY` steps, 5 s timeouts."""
    return [
        sys.executable, "-m", "trainers.train", "task=mlp", "mesh=cpu4_group",
        "reduction=diloco_elastic", f"reduction.axes.slice.every_steps={EVERY}",
        f"{KEY}.group={gid}", f"{KEY}.lighthouse={lighthouse}", f"{KEY}.timeout_s=5",
        f"{KEY}.heartbeat_s=0.1", "trainer.batch_size=16", "trainer.steps=32",
        "trainer.progress=false", "checkpoint.enabled=false", f"hydra.run.dir={run_dir}",
        "+allowed_targets=[tests.]", *extra,
    ]  # fmt: skip


def held_until_joined(log: Path) -> str:
    """Group 0's hooks: paced, and held at `HOLD_AT` until the late group (its output in
    `log`) waits in its first quorum, so that the late group joins group 0's next sync."""
    return (
        "trainer.hooks=[{_target_:tests.multihost_hooks.Pace,seconds:0.05},"
        f"{{_target_:tests.multihost_hooks.WaitForText,path:'{log}',text:'joining its peers',"
        f"count:1,step:{HOLD_AT},timeout:90}}]"
    )


def run_late_joiner(lighthouse: str, tmp_path: Path, late_id: int, *late: str) -> tuple:
    """Group 0, and a group `late_id` started once group 0 trains, with the `late` overrides;
    both run to their end. Returns (group 0's exit status, its output, the late group's exit
    status, its output)."""
    logs = {name: tmp_path / f"{name}.log" for name in ("first", "late")}
    first_cmd = group(lighthouse, 0, tmp_path / "g0", held_until_joined(logs["late"]))
    with open(logs["first"], "w") as out:
        first = subprocess.Popen(first_cmd, cwd=REPO, env=ENV, stdout=out, stderr=out)
    deadline = time.monotonic() + 180  # group 0 past its join (two starting together: both refused)
    while "] - Training " not in logs["first"].read_text():
        assert first.poll() is None and time.monotonic() < deadline, logs["first"].read_text()
        time.sleep(0.1)
    with open(logs["late"], "w") as out:
        late_cmd = group(lighthouse, late_id, tmp_path / "late", *late)
        second = subprocess.run(late_cmd, cwd=REPO, env=ENV, stdout=out, stderr=out, timeout=240)
    code = first.wait(timeout=240)
    return code, logs["first"].read_text(), second.returncode, logs["late"].read_text()


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


def test_a_group_with_another_config_is_refused_at_join_naming_the_keys(lighthouse, tmp_path):
    code, first, late_code, late = run_late_joiner(
        lighthouse, tmp_path, 1, "optimizer.learning_rate=0.5", "seed=3"
    )
    assert late_code == 2, late[-3000:]
    line = last_line(late)
    assert line.startswith(f"xshard: error: {KEY}: the groups run different configs:"), line
    assert "optimizer.learning_rate (" in line and "0.5 on group 1" in line, line
    assert "seed (" in line and "3 on group 1" in line, line
    assert "trainer.hooks" not in line.split("configs:")[1].split(". Every")[0]  # may differ
    warned = [x for x in first.splitlines() if "the groups run different configs" in x]
    assert len(warned) == 1 and "optimizer.learning_rate (" in warned[0], first[-3000:]
    assert "The group joining is refused; group 0 goes on." in warned[0]
    assert code == 0, first[-3000:]  # group 0 trained to its end
    assert "Traceback" not in first + late


def test_a_second_group_claiming_an_id_is_refused_naming_the_key_and_id(lighthouse, tmp_path):
    code, first, late_code, late = run_late_joiner(lighthouse, tmp_path, 0)
    assert late_code == 2, late[-3000:]
    assert last_line(late) == (
        f"xshard: error: {KEY}.group=0: 2 groups in the quorum claim this id; give each group "
        "its own id (0, 1, ...)."
    )
    assert sum("2 groups in the quorum claim this id" in x for x in first.splitlines()) == 1
    assert code == 0, first[-3000:]
    assert "Traceback" not in first + late


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Waits until `path` exists, while `proc` (its output in `log`) runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def test_a_stopped_group_is_dropped_and_refused_cleanly_once_continued(lighthouse, tmp_path):
    """SIGSTOP of group 1 among its inner steps: group 0's next sync waits for the lighthouse's
    heartbeat timeout, then commits alone, and group 0 trains on; SIGCONT'd, group 1 reaches
    its sync behind its peer (it missed a committed sync) and exits 4 with one line (its loop
    cannot jump to the peer's step; restarted, it rejoins from a live peer)."""
    dumps, procs, logs = tmp_path / "dumps", {}, {}
    for gid in (0, 1):
        hooks = (
            "trainer.hooks=[{_target_:tests.multihost_hooks.Pace,seconds:0.1},"
            f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{gid}',every:{EVERY}}}]"
        )
        logs[gid] = tmp_path / f"g{gid}.log"
        command = group(lighthouse, gid, tmp_path / f"g{gid}", hooks, "trainer.steps=64")
        with open(logs[gid], "w") as out:
            procs[gid] = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=out)
    wait_for(dumps / "g1" / "step16.process0.npz", procs[1], logs[1])
    os.kill(procs[1].pid, signal.SIGSTOP)  # among its inner steps 17..24
    try:
        wait_for(dumps / "g0" / "step32.process0.npz", procs[0], logs[0])  # 2 syncs without it
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    code, late_code = procs[0].wait(timeout=240), procs[1].wait(timeout=240)
    first, late = logs[0].read_text(), logs[1].read_text()
    assert code == 0, first[-3000:]
    assert late_code == 4, late[-3000:]
    assert last_line(late).startswith(
        "xshard: error: this group is at step 24 and its peers at "
    ), late[-3000:]
    assert "Traceback" not in first + late
    assert not (dumps / "g1" / "step24.process0.npz").exists()  # its sync at 24 never applied


def start_lighthouse(bind: str, min_groups: int = 2) -> subprocess.Popen:
    """A lighthouse of its own on `bind` (the test kills it), whose quorums need `min_groups`
    groups: with both groups, the restarted one would otherwise commit group 0's next sync alone
    if group 0's heartbeat reached it first, leaving group 1 behind (exit 4: restarted, it
    rejoins; no supervisor here)."""
    command = [
        sys.executable, "-m", "trainers.elastic", "lighthouse", "--bind", bind,
        "--min-groups", str(min_groups), "--heartbeat-timeout-s", "1", "--join-timeout-s", "20",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, env=ENV, stderr=subprocess.DEVNULL)


def test_groups_go_on_after_the_lighthouse_is_killed_and_restarted(tmp_path):
    bind, dumps, procs, logs = f"127.0.0.1:{free_port()}", tmp_path / "dumps", {}, {}
    house = start_lighthouse(bind)
    try:
        for gid in (0, 1):
            hooks = (
                "trainer.hooks=[{_target_:tests.multihost_hooks.Pace,seconds:0.1},"
                f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{gid}',every:{EVERY}}}]"
            )
            logs[gid] = tmp_path / f"g{gid}.log"
            command = group(
                bind,
                gid,
                tmp_path / f"g{gid}",
                hooks,
                "trainer.steps=48",
                RETRY_EVERY_2S,
                f"{KEY}.min_groups=2",
            )
            with open(logs[gid], "w") as out:
                procs[gid] = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=out)
        wait_for(dumps / "g0" / "step16.process0.npz", procs[0], logs[0])
        house.kill()
        house.wait()
        time.sleep(1.0)  # the groups' next sync meets no lighthouse
        house = start_lighthouse(bind)
        codes = [procs[g].wait(timeout=120) for g in (0, 1)]
    finally:
        for proc in (house, *procs.values()):
            proc.kill()
            proc.wait()
    out = {g: logs[g].read_text() for g in (0, 1)}
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert all("lighthouse quorum failed" in out[g] for g in (0, 1))  # a sync met no lighthouse
    assert "Traceback" not in out[0] + out[1]


def wait_for_text(log: Path, text: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Waits until `text` is in `log`, the output of `proc`, while `proc` runs."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def test_a_group_stopped_in_its_quorum_leaves_it_and_resumes_alone_after_the_others(tmp_path):
    """Group 1 held after step 20 (a hook; its heartbeats go on): group 0 waits in the quorum of
    its sync at step 24 (the lighthouse, ``--min-groups 2``, forms none of one group). SIGTERM
    there leaves the round at once, not after ``quorum_timeout_s=120``: exit 75 with the
    checkpoint of step 24 from before the sync. Group 1 killed, the lighthouse restarted with
    ``--min-groups 1``: group 0 restarted (no peer left) resumes from its own checkpoint and
    trains alone to its end."""
    bind, procs, logs = f"127.0.0.1:{free_port()}", {}, {}
    house = start_lighthouse(bind)
    command = [
        f"{KEY}.quorum_timeout_s=120", "checkpoint.enabled=true",
        f"checkpoint.every_steps={EVERY}", "checkpoint.async_save=false",
    ]  # fmt: skip
    held = (
        "trainer.hooks=[{_target_:tests.multihost_hooks.WaitForText,"
        f"path:'{tmp_path / 'never'}',text:go,count:1,step:20,timeout:200}}]"
    )
    try:
        for gid, hooks in ((0, "trainer.hooks=[]"), (1, held)):
            logs[gid] = tmp_path / f"g{gid}.log"
            with open(logs[gid], "w") as out:
                procs[gid] = subprocess.Popen(
                    group(bind, gid, tmp_path / f"g{gid}", *command, hooks),
                    cwd=REPO, env=ENV, stdout=out, stderr=out,
                )  # fmt: skip
        wait_for_text(logs[0], "Sync at step 24: exchanging with the other groups.", procs[0])
        time.sleep(1.0)  # its quorum request is out
        procs[0].send_signal(signal.SIGTERM)
        stopped = procs[0].wait(timeout=30)  # a bound, well under quorum_timeout_s
    finally:
        for proc in (house, *procs.values()):
            proc.kill()
            proc.wait()
    house = start_lighthouse(bind, min_groups=1)
    try:
        with open(tmp_path / "g0.restart.log", "w") as out:
            again = subprocess.run(
                group(bind, 0, tmp_path / "g0", *command, "trainer.hooks=[]"),
                cwd=REPO, env=ENV, stdout=out, stderr=out, timeout=240,
            )  # fmt: skip
    finally:
        house.kill()
        house.wait()
    first, restart = logs[0].read_text(), (tmp_path / "g0.restart.log").read_text()
    assert stopped == 75, first[-3000:]
    assert "Sync at step 24 left on a stop request" in first, first[-3000:]
    assert last_line(first).startswith("xshard: preempted: Stopped by SIGTERM at step 24 of 32;")
    assert again.returncode == 0, restart[-3000:]
    assert "Restored step 24 from" in restart, restart[-3000:]  # its own checkpoint
    assert "(8 trained in this run)" in restart and "Group 0 rejoined" not in restart
    assert (tmp_path / "g0" / "checkpoints" / "32").exists()
    assert "Traceback" not in first + restart + logs[1].read_text()


def test_the_supervisor_stops_at_once_when_a_group_is_refused_its_config(tmp_path):
    """A config every group is refused (here: no ``slice`` axis in the default mesh) is not
    restarted: a restart would be refused the same way. The supervisor stops the others and
    exits 2 with the group's one-line error; each group started once."""
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "trainers.elastic", "run", "--groups", "2", "--out", str(out),
        "--bind", f"127.0.0.1:{free_port()}", "--restarts", "3", "--", "task=mlp",
        "reduction=diloco_elastic", "trainer.progress=false",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    line = next(ln for ln in done.stderr.splitlines() if "refused:" in ln)
    assert "not restarted (it would be refused again); stopping." in line
    assert "reduction.axes.slice: the mesh has no axis 'slice'" in line
    assert "restarting it" not in done.stderr
    starts = [
        (out / f"group_{g}.log").read_text().count("Run failed during start-up") for g in (0, 1)
    ]
    assert max(starts) == 1, starts  # the other may have been stopped before it failed
