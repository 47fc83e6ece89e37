"""An emulated slow link between two processes: two network namespaces joined by a veth pair.

`emulated_link` (a context manager) makes namespaces ``xdcn<pid>-0`` and ``xdcn<pid>-1``,
joined by a veth pair with addresses `ADDRESSES`, and `Link.set_rate` limits the rate of both
ends with ``tc qdisc ... tbf`` (``None``: unlimited). A command runs inside a namespace through
``ip netns exec`` (`Link.prefix`). The machine's host name resolves, inside each namespace, to
that namespace's veth address (an ``/etc/netns/<name>/hosts`` file, which ``ip netns exec``
mounts over ``/etc/hosts``): gloo's TCP transport (that of ``jax.distributed``) advertises the
address of the host name, so each process must find its own veth address there, not
``127.0.0.1`` (`Link.write_hosts` can make it resolve to ``127.0.0.1``: elastic groups take
their address from ``elastic.host`` alone).

Everything made is removed on every way out of the ``with`` block, and namespaces left behind by
a process that no longer exists (killed before its cleanup ran) are removed when a link is made.
Needs root, ``ip`` (iproute2) and the ``tbf`` queueing discipline: `unavailable` says which is
missing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ADDRESSES = ("10.213.0.1", "10.213.0.2")
PREFIX = "xdcn"
ETC_NETNS = Path("/etc/netns")
#: tbf's bucket: at least this many bytes, else 1 ms of traffic at the rate.
MIN_BURST_BYTES = 16 * 1024


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Removes the namespaces (and their hosts files) of links whose process has ended;
    returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split()
    stale = []
    for name in listed:
        match = re.fullmatch(rf"{PREFIX}(\d+)-[01]", name)
        if match and not _alive(int(match.group(1))):
            _remove(name)
            stale.append(name)
    return stale


def _remove(namespace: str) -> None:
    """Deletes a namespace (its veth end goes with it, and the pair with that) and its hosts."""
    _ip("netns", "del", namespace, check=False)
    shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)


def unavailable() -> str | None:
    """Why namespaces with a tbf-limited veth pair cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "no `ip` or `tc` (iproute2) on PATH"
    try:
        with emulated_link() as link:
            link.set_rate("10mbit")
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        return f"cannot make a tbf-limited veth pair between namespaces: {detail}".strip()
    return None


class Link:
    """Two namespaces joined by a veth pair (made by `emulated_link`)."""

    def __init__(self, tag: str) -> None:
        self.namespaces = (f"{PREFIX}{tag}-0", f"{PREFIX}{tag}-1")
        self.devices = (f"xd{tag}a", f"xd{tag}b")
        self.rate: str | None = None

    def create(self) -> None:
        """Makes the namespaces, the veth pair, the addresses and the hosts files."""
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
        _ip("link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        for namespace, device, address in zip(self.namespaces, self.devices, ADDRESSES):
            _ip("link", "set", device, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", namespace, "link", "set", device, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        self.write_hosts()

    def write_hosts(self, own_address: bool = True) -> None:
        """Each namespace's hosts file: the machine's host name resolves to the namespace's
        veth address, or (`own_address` false) to ``127.0.0.1``, where no peer reaches it.
        A process reads it at each look-up: it may change while commands run."""
        host = socket.gethostname()
        for namespace, address in zip(self.namespaces, ADDRESSES):
            (ETC_NETNS / namespace).mkdir(parents=True, exist_ok=True)
            named = address if own_address else "127.0.0.1"
            hosts = f"127.0.0.1 localhost\n{named} {host}\n"
            (ETC_NETNS / namespace / "hosts").write_text(hosts)

    def set_rate(self, rate: str | None) -> None:
        """Limits both ends to `rate` (tc's syntax: ``10mbit``, ``1gbit``); None: unlimited."""
        for namespace, device in zip(self.namespaces, self.devices):
            tc = ["tc", "-n", namespace, "qdisc"]
            if rate is None:
                subprocess.run([*tc, "del", "dev", device, "root"], capture_output=True)
                continue
            burst = max(MIN_BURST_BYTES, rate_bytes_per_s(rate) // 1000)
            subprocess.run(
                [*tc, "replace", "dev", device, "root", "tbf", "rate", rate]
                + ["burst", str(burst), "latency", "100ms"],
                capture_output=True,
                text=True,
                check=True,
            )
        self.rate = rate

    def prefix(self, process: int) -> list[str]:
        """The command prefix that runs a command in process `process`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[process]]

    def remove(self) -> None:
        """Deletes both namespaces, the veth pair and the hosts files."""
        for namespace in self.namespaces:
            _remove(namespace)
        _ip("link", "del", self.devices[0], check=False)  # when it never left this namespace


@contextmanager
def emulated_link() -> Iterator[Link]:
    """Two namespaces joined by an unlimited veth pair, removed on every way out."""
    remove_stale()
    link = Link(str(os.getpid()))
    try:
        link.create()
        yield link
    finally:
        link.remove()


_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def rate_bytes_per_s(rate: str) -> int:
    """Bytes per second of a tc rate in bits (``10mbit`` -> 1,250,000)."""
    match = re.fullmatch(r"(\d+)([kmg]?bit)", rate.lower())
    if match is None:
        raise ValueError(f"rate {rate!r}: expected <number>bit, kbit, mbit or gbit")
    return int(match.group(1)) * _UNITS[match.group(2)] // 8
