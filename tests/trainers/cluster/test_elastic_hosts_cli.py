"""Elastic replica groups on two emulated hosts (slow, multiprocess): real torchft, real JAX,
each process its own ``python -m trainers.train`` in a network namespace (`benchmarks.netns`:
two namespaces joined by a veth pair, ``10.213.0.1`` and ``10.213.0.2``), the lighthouse in
namespace 0. Skipped where namespaces cannot be made (not root, no ``ip``).

Groups on two hosts: group 0 in namespace 0, group 1 in namespace 1, each with ``elastic.host``
its own veth address, the host name resolving to 127.0.0.1 in both (where no peer reaches a
group: what a group advertises and where it listens, its gloo connections included, come from
``elastic.host`` alone). Both commit syncs (outer params bitwise equal after each); every
socket a group listens on is on its own address (read from ``/proc/<pid>/net``); group 1 is
killed (SIGKILL) among its inner steps and restarted, and rejoins from group 0 across the link.

A group spread over both hosts: 2 groups of 2 ``jax.distributed`` processes each, process k of
each group in namespace k with its own ``elastic.host`` (the coordinator and the group's store
on process 0's host): both groups commit syncs, each process's outer params bitwise equal to
the same process's of the other group; each listens on its own address (the coordinator of
``jax.distributed``, on every interface, aside)."""

from __future__ import annotations

import os
import signal
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
from tests.multihost_cli import PROCESSES, distributed, free_port, listening

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.long]

UNAVAILABLE = netns.unavailable()
EVERY, STEPS, KILL_AFTER, HOLD_AT = 8, 40, 16, 24
KEY = "reduction.axes.slice.elastic"
ENV = {**os.environ, "HYDRA_FULL_ERROR": "0"}
Listening = set[tuple[str, int]]  # (address, port)


class Run(NamedTuple):
    """What a run left: its processes' exit statuses and outputs (by name), the outer params
    dumped after each sync, and what each process listened on."""

    codes: dict[str, int]
    logs: dict[str, str]
    dumps: Path
    listening: dict[str, Listening]


def lighthouse(link: netns.Link, port: int) -> subprocess.Popen:
    """The lighthouse in namespace 0, on its veth address."""
    command = [
        *link.prefix(0), sys.executable, "-m", "trainers.elastic", "lighthouse", "--bind",
        f"{netns.ADDRESSES[0]}:{port}", "--min-groups", "1", "--heartbeat-timeout-s", "1",
        "--join-timeout-s", "20",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, env=ENV, stderr=subprocess.DEVNULL)


def process(link: netns.Link, ns: int, gid: int, port: int, hooks: list[str], *extra: str) -> list:
    """A process of group `gid` in namespace `ns`, advertising that namespace's address."""
    return [
        *link.prefix(ns), sys.executable, "-m", "trainers.train", "task=mlp", "mesh=cpu4_group",
        "reduction=diloco_elastic", f"reduction.axes.slice.every_steps={EVERY}",
        f"{KEY}.group={gid}", f"{KEY}.lighthouse={netns.ADDRESSES[0]}:{port}",
        f"{KEY}.host={netns.ADDRESSES[ns]}", f"{KEY}.timeout_s=10", f"{KEY}.heartbeat_s=0.1",
        "trainer.batch_size=16", "trainer.progress=false", "checkpoint.enabled=false",
        "+allowed_targets=[tests.]", f"trainer.hooks=[{','.join(hooks)}]", *extra,
    ]  # fmt: skip


def hooks(dumps: Path, gid: int, *more: str) -> list[str]:
    """Paced steps, the outer params dumped after every sync into ``<dumps>/g<gid>``."""
    return [
        "{_target_:tests.multihost_hooks.Pace,seconds:0.05}",
        f"{{_target_:tests.multihost_hooks.DumpOuter,dir:'{dumps}/g{gid}',every:{EVERY}}}",
        *more,
    ]


def wait_for_text(path: Path, text: str, step: int) -> str:
    """A hook holding the run after `step` until `path` holds `text`."""
    return (
        f"{{_target_:tests.multihost_hooks.WaitForText,path:'{path}',text:'{text}',"
        f"count:1,step:{step},timeout:120}}"
    )


def wait_for(path: Path, procs: dict[str, subprocess.Popen], timeout: float = 120.0) -> None:
    """Waits until `path` exists, while every process of `procs` runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        ended = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not ended and time.monotonic() < deadline, f"{path.name}: ended {ended}"
        time.sleep(0.02)


def start(name: str, command: list[str], tmp: Path, procs: dict[str, subprocess.Popen]) -> None:
    """Starts `command` as `procs[name]`, its output in ``<tmp>/<name>.log``."""
    with open(tmp / f"{name}.log", "w") as out:
        procs[name] = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=out)


def finish(house: subprocess.Popen, procs: dict[str, subprocess.Popen], tmp: Path) -> tuple:
    """Every process's exit status (240 s at most) and output; the lighthouse stopped."""
    try:
        codes = {name: proc.wait(timeout=240) for name, proc in procs.items()}
    finally:
        for proc in (house, *procs.values()):
            proc.kill()
            proc.wait()
    return codes, {name: (tmp / f"{name}.log").read_text() for name in procs}


def two_hosts(link: netns.Link, tmp: Path) -> Run:
    """Group 0 in namespace 0, group 1 in namespace 1; group 1 killed after its sync at
    `KILL_AFTER` and restarted; group 0 held at `HOLD_AT` until the restarted group 1 waits in
    its first quorum (it rejoins from group 0)."""
    link.write_hosts(own_address=False)
    port, dumps, procs = free_port(), tmp / "dumps", {}
    joined = wait_for_text(tmp / "g1 again.log", "joining its peers", HOLD_AT)
    commands = {
        gid: process(link, gid, gid, port, hooks(dumps, gid, *([joined] if gid == 0 else [])),
                     f"trainer.steps={STEPS}", f"hydra.run.dir={tmp}/g{gid}")
        for gid in (0, 1)
    }  # fmt: skip
    house = lighthouse(link, port)
    try:
        start("g0", commands[0], tmp, procs)
        start("g1", commands[1], tmp, procs)
        wait_for(dumps / "g1" / f"step{KILL_AFTER}.process0.npz", procs)
        seen = {name: listening(procs[name].pid) for name in ("g0", "g1")}
        seen["lighthouse"] = listening(house.pid)
        os.kill(procs["g1"].pid, signal.SIGKILL)  # among its inner steps 17..24
        procs["g1"].wait()
        start("g1 again", commands[1], tmp, procs)
    finally:
        codes, logs = finish(house, procs, tmp)
    return Run(codes, logs, dumps, seen)


def spread(link: netns.Link, tmp: Path) -> Run:
    """2 groups of 2 processes, process k of each in namespace k, `2 * EVERY` steps; every
    process held after its first sync until the test has read what it listens on (less the
    coordinator of ``jax.distributed`` on process 0, which listens on every interface)."""
    link.write_hosts(own_address=True)  # jax.distributed's gloo takes the host name's address
    port, dumps, procs = free_port(), tmp / "dumps", {}
    release = wait_for_text(tmp / "release", "go", EVERY + 2)
    coordinators = {f"g{gid}p0": free_port() for gid in (0, 1)}
    house = lighthouse(link, port)
    try:
        for gid in (0, 1):
            for k in range(PROCESSES):
                command = process(
                    link, k, gid, port, hooks(dumps, gid, release), f"trainer.steps={2 * EVERY}",
                    f"hydra.run.dir={tmp}/g{gid}",
                    *distributed(coordinators[f"g{gid}p0"], k, netns.ADDRESSES[0]),
                    "sharding.zero_stage=1",  # each process holds a part of the outer params
                )  # fmt: skip
                start(f"g{gid}p{k}", command, tmp, procs)
        for gid in (0, 1):
            for k in range(PROCESSES):
                wait_for(dumps / f"g{gid}" / f"step{EVERY}.process{k}.npz", procs, 240)
        seen = {
            name: listening(proc.pid) - {("::", coordinators.get(name))}
            for name, proc in procs.items()
        }
        (tmp / "release").write_text("go")
    finally:
        codes, logs = finish(house, procs, tmp)
    return Run(codes, logs, dumps, seen)


@pytest.fixture(scope="module")
def link() -> Iterator[netns.Link]:
    if UNAVAILABLE is not None:
        pytest.skip(UNAVAILABLE)
    with netns.emulated_link() as made:
        yield made


@pytest.fixture(scope="module")
def hosts(link, tmp_path_factory) -> Run:
    return two_hosts(link, tmp_path_factory.mktemp("hosts"))


@pytest.fixture(scope="module")
def spread_run(link, tmp_path_factory) -> Run:
    return spread(link, tmp_path_factory.mktemp("spread"))


def assert_outer_equal(dumps: Path, steps: set[int], processes: int) -> list[int]:
    """After each sync both groups dumped, each process's outer params are bitwise equal to
    the same process's of the other group; returns those syncs' steps."""

    def dump(gid: int, k: int, step: int) -> Path:
        return dumps / f"g{gid}" / f"step{step}.process{k}.npz"

    every = [(g, k) for g in (0, 1) for k in range(processes)]
    both = [s for s in sorted(steps) if all(dump(g, k, s).exists() for g, k in every)]
    for step in both:
        for k in range(processes):
            g0, g1 = (np.load(dump(g, k, step)) for g in (0, 1))
            outer = sorted(key for key in g0.files if key.startswith("outer_"))
            assert outer
            for key in outer:
                np.testing.assert_array_equal(g0[key], g1[key], err_msg=f"step {step} {key}")
    return both


def test_groups_on_two_hosts_commit_syncs_and_a_killed_one_rejoins_across_the_link(hosts):
    assert hosts.codes["g0"] == 0, hosts.logs["g0"][-3000:]
    assert hosts.codes["g1"] == -signal.SIGKILL
    assert hosts.codes["g1 again"] == 0, hosts.logs["g1 again"][-3000:]
    assert "Group 1 rejoined at step" in hosts.logs["g1 again"], hosts.logs["g1 again"][-3000:]
    assert "Traceback" not in hosts.logs["g0"] + hosts.logs["g1 again"]
    both = assert_outer_equal(hosts.dumps, set(range(EVERY, STEPS + 1, EVERY)), 1)
    assert {EVERY, KILL_AFTER, STEPS} <= set(both), both  # before the kill, after the rejoin


def test_each_group_listens_on_its_own_address_only(hosts):
    for gid in (0, 1):
        seen = hosts.listening[f"g{gid}"]
        assert len(seen) >= 4, seen  # store, manager server, checkpoint server, gloo
        assert {address for address, _ in seen} == {netns.ADDRESSES[gid]}, (gid, seen)
    assert {address for address, _ in hosts.listening["lighthouse"]} == {netns.ADDRESSES[0]}


def test_a_group_spread_over_two_hosts_syncs_with_its_peer(spread_run):
    for name, code in spread_run.codes.items():
        assert code == 0, spread_run.logs[name][-3000:]
        assert "Traceback" not in spread_run.logs[name]
    both = assert_outer_equal(spread_run.dumps, {EVERY, 2 * EVERY}, PROCESSES)
    assert both == [EVERY, 2 * EVERY]
    parts = [np.load(spread_run.dumps / "g0" / f"step{EVERY}.process{k}.npz") for k in (0, 1)]
    assert parts[0]["outer_0"].tobytes() != parts[1]["outer_0"].tobytes()  # parts, not copies


def test_each_process_of_a_spread_group_listens_on_its_own_address(spread_run):
    for name, seen in spread_run.listening.items():
        k = int(name[-1])  # its namespace
        assert {address for address, _ in seen} == {netns.ADDRESSES[k]}, (name, seen)
        # process 0: the store, the manager server, the checkpoint server, 2 gloo (torchft's,
        # jax.distributed's); process 1: the checkpoint server and the 2 gloo
        assert len(seen) >= (5 if k == 0 else 3), (name, seen)
