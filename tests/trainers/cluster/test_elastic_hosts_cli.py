"""Elastic replica groups on two emulated hosts (slow, multiprocess): real torchft, real JAX,
each group its own ``python -m trainers.train`` in its own network namespace
(`benchmarks.netns`: two namespaces joined by a veth pair, ``10.213.0.1`` and ``10.213.0.2``).

The lighthouse and group 0 run in namespace 0, group 1 in namespace 1, each group with
``elastic.host`` its own veth address and the lighthouse across the link for group 1: both
commit syncs (their outer params bitwise equal after each), every manager, store and checkpoint
server of a group listens on its own address only (its sockets read from ``/proc/<pid>/net``);
group 1 is killed (SIGKILL) among its inner steps and restarted, and rejoins from group 0
across the link. In both namespaces the host name resolves to 127.0.0.1 (where no peer reaches
a group): what a group advertises and where it listens, its gloo connections included, come
from ``elastic.host`` alone. Skipped where namespaces cannot be made (not root, no ``ip``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from benchmarks import netns
from tests import REPO
from tests.multihost_cli import free_port, listening

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]

UNAVAILABLE = netns.unavailable()
EVERY, STEPS, KILL_AFTER, HOLD_AT = 8, 40, 16, 24
KEY = "reduction.axes.slice.elastic"
ENV = {**os.environ, "HYDRA_FULL_ERROR": "0"}


class Hosts(NamedTuple):
    """What the run left: the groups' outputs and folders, and what each group listened on."""

    codes: dict[str, int]  # "g0", "g1" (killed), "g1 again": exit statuses
    logs: dict[str, str]
    dumps: Path
    listening: dict[int, set[tuple[str, int]]]  # group -> (address, port) it listened on
    lighthouse: tuple[str, int]


def group(link: netns.Link, gid: int, lighthouse: str, tmp: Path, hooks: list[str]) -> list[str]:
    """Group `gid`'s command in namespace `gid`, advertising its own veth address."""
    return [
        *link.prefix(gid), sys.executable, "-m", "trainers.train", "task=mlp", "mesh=cpu4_group",
        "reduction=diloco_elastic", f"reduction.axes.slice.every_steps={EVERY}",
        f"{KEY}.group={gid}", f"{KEY}.lighthouse={lighthouse}",
        f"{KEY}.host={netns.ADDRESSES[gid]}", f"{KEY}.timeout_s=10",
        f"{KEY}.heartbeat_s=0.1", "trainer.batch_size=16",
        f"trainer.steps={STEPS}", "trainer.progress=false", "checkpoint.enabled=false",
        f"hydra.run.dir={tmp}/g{gid}", "+allowed_targets=[tests.]",
        f"trainer.hooks=[{','.join(hooks)}]",
    ]  # fmt: skip


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    """Waits until `path` exists, while `proc` (its output in `log`) runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def run_groups(link: netns.Link, tmp: Path) -> Hosts:
    """The lighthouse and group 0 in namespace 0, group 1 in namespace 1; group 1 killed after
    its sync at `KILL_AFTER` and restarted; group 0 held at `HOLD_AT` until the restarted
    group 1 waits in its first quorum (it rejoins from group 0)."""
    port, dumps = free_port(), tmp / "dumps"
    lighthouse = (netns.ADDRESSES[0], port)
    house = subprocess.Popen(
        [
            *link.prefix(0),
            sys.executable,
            "-m",
            "trainers.elastic",
            "lighthouse",
            "--bind",
            f"{lighthouse[0]}:{port}",
            "--min-groups",
            "1",
            "--heartbeat-timeout-s",
            "1",
            "--join-timeout-s",
            "20",
        ],  # fmt: skip
        cwd=REPO,
        env=ENV,
        stderr=subprocess.DEVNULL,
    )
    logs = {name: tmp / f"{name}.log" for name in ("g0", "g1", "g1 again")}
    hooks = {
        gid: [
            "{_target_:tests.multihost_hooks.Pace,seconds:0.05}",
            f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{gid}',every:{EVERY}}}",
        ]
        for gid in (0, 1)
    }
    hooks[0].append(
        f"{{_target_:tests.multihost_hooks.WaitForText,path:'{logs['g1 again']}',"
        f"text:'joining its peers',count:1,step:{HOLD_AT},timeout:120}}"
    )
    commands = {gid: group(link, gid, f"{lighthouse[0]}:{port}", tmp, hooks[gid]) for gid in (0, 1)}
    procs: dict[str, subprocess.Popen] = {}
    seen: dict[int, set[tuple[str, int]]] = {}
    try:
        for name, gid in (("g0", 0), ("g1", 1)):
            with open(logs[name], "w") as out:
                procs[name] = subprocess.Popen(
                    commands[gid], cwd=REPO, env=ENV, stdout=out, stderr=out
                )
        wait_for(dumps / "g1" / f"step{KILL_AFTER}.process0.npz", procs["g1"], logs["g1"])
        seen = {gid: listening(procs[f"g{gid}"].pid) for gid in (0, 1)}
        os.kill(procs["g1"].pid, signal.SIGKILL)  # among its inner steps 17..24
        procs["g1"].wait()
        with open(logs["g1 again"], "w") as out:
            procs["g1 again"] = subprocess.Popen(
                commands[1], cwd=REPO, env=ENV, stdout=out, stderr=out
            )
        codes = {name: proc.wait(timeout=240) for name, proc in procs.items()}
    finally:
        for proc in (house, *procs.values()):
            proc.kill()
            proc.wait()
    texts = {name: log.read_text() for name, log in logs.items()}
    return Hosts(codes, texts, dumps, seen, lighthouse)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory) -> Iterator[Hosts]:
    if UNAVAILABLE is not None:
        pytest.skip(UNAVAILABLE)
    with netns.emulated_link() as link:
        for namespace in link.namespaces:  # nothing may find its address from the host name
            hosts = f"127.0.0.1 localhost {socket.gethostname()}\n"
            (netns.ETC_NETNS / namespace / "hosts").write_text(hosts)
        yield run_groups(link, tmp_path_factory.mktemp("hosts"))


def test_groups_on_two_hosts_commit_syncs_and_a_killed_one_rejoins_across_the_link(hosts):
    assert hosts.codes["g0"] == 0, hosts.logs["g0"][-3000:]
    assert hosts.codes["g1"] == -signal.SIGKILL
    assert hosts.codes["g1 again"] == 0, hosts.logs["g1 again"][-3000:]
    assert "Group 1 rejoined at step" in hosts.logs["g1 again"], hosts.logs["g1 again"][-3000:]
    assert "Traceback" not in hosts.logs["g0"] + hosts.logs["g1 again"]
    both = [
        step
        for step in range(EVERY, STEPS + 1, EVERY)
        if all((hosts.dumps / f"g{g}" / f"step{step}.process0.npz").exists() for g in (0, 1))
    ]
    assert {EVERY, KILL_AFTER, STEPS} <= set(both), both  # before the kill, after the rejoin
    for step in both:
        g0, g1 = (np.load(hosts.dumps / f"g{g}" / f"step{step}.process0.npz") for g in (0, 1))
        outer = sorted(k for k in g0.files if k.startswith("outer_"))
        assert outer
        for k in outer:
            np.testing.assert_array_equal(g0[k], g1[k], err_msg=f"step {step} {k}")


def test_each_group_listens_on_its_own_address_only(hosts):
    for gid, seen in hosts.listening.items():
        assert seen, f"group {gid} listens on nothing"
        assert {address for address, _ in seen} == {netns.ADDRESSES[gid]}, (gid, seen)
