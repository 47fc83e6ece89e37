"""Where a replica group's servers listen: on its ``elastic.host`` only, never on every interface.

A group (`trainers.cluster.torchft_group`) opens three servers, and none of them takes an address
to listen on: torch's ``TCPStore`` binds every interface, torchft 0.2.0's manager server binds
``[::]`` (``torchft/manager.py``) and its checkpoint server ``("", 0)``
(``torchft/checkpointing/http_transport.py``), which serves the group's state as pickle. On a
host with several networks, each would accept connections from all of them. Its gloo
connections to the other groups take the address ``gethostname()`` resolves to (else loopback).

`resolve` turns the configured host into the address it names on this host (refused with one
line naming the key when it does not resolve or is not this host's); `tcp_store` hands the
store a socket already bound there (torch's ``master_listen_fd``); `servers_on` makes the
manager server and the checkpoint server that torchft creates inside it bind there: torchft
looks both classes up in its modules when it creates them, and `servers_on` puts in their
place, for the duration of the block only, the same classes bound to the address (the pin
``torchft==0.2.0`` in pyproject.toml keeps those names; tests/trainers/cluster/
test_elastic_hosts_cli.py reads what each group listens on); `GlooOn` gives gloo a device on
the address at each new quorum.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any, NamedTuple

import torch.distributed as dist
import torchft.checkpointing.http_transport as http_transport
import torchft.manager as torchft_manager
import torchft.process_group as torchft_process_group
from torch.distributed import ProcessGroupGloo as BaseProcessGroupGloo
from torchft.process_group import ProcessGroupGloo

from xshard.errors import ConfigError

#: torchft's backlog for its checkpoint server (its ``_IPv6HTTPServer``).
_BACKLOG = 1024


class Address(NamedTuple):
    """Where a group's servers listen: the address `host` names on this host, and its family."""

    ip: str
    family: socket.AddressFamily


def resolve(host: str, key: str) -> Address:
    """The address `host` (``<key>.host``) names, checked to be one of this host's.

    Raises:
      ConfigError: one line naming the key and the value, when `host` does not resolve or
        this host cannot listen there.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        address = Address(str(sockaddr[0]), socket.AddressFamily(family))
        with socket.socket(address.family, socket.SOCK_STREAM) as probe:
            probe.bind((address.ip, 0))
    except OSError as e:  # socket.gaierror included
        raise ConfigError(
            f"{key}.host={host}: this process cannot listen there ({e.strerror or e}); expected "
            "an address (or host name) of this host, where its peers reach it."
        ) from None
    return address


def tcp_store(address: Address) -> dist.TCPStore:
    """The group's store (its process 0 hosts it), listening on `address` only."""
    listener = socket.create_server((address.ip, 0), family=address.family)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        address.ip,
        port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here on
    )


def _host_port(address: Address) -> str:
    return f"[{address.ip}]:0" if address.family == socket.AF_INET6 else f"{address.ip}:0"


@contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    """`module`'s `name` is `value` inside the block, and what it was again after it."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextmanager
def servers_on(address: Address) -> Iterator[None]:
    """Inside the block, the manager server and the checkpoint server torchft makes listen on
    `address` only (an ephemeral port each), not on every interface."""
    manager_server = torchft_manager.ManagerServer

    def bound_manager_server(**kwargs: Any) -> Any:
        return manager_server(**{**kwargs, "bind": _host_port(address)})

    class BoundHTTPServer(ThreadingHTTPServer):
        """torchft's checkpoint server, bound to `address` whatever it asks for."""

        address_family = address.family
        request_queue_size = _BACKLOG

        def __init__(self, _anywhere: Any, handler: Any):
            super().__init__((address.ip, 0), handler)

    with (
        _replaced(torchft_manager, "ManagerServer", bound_manager_server),
        _replaced(http_transport, "_IPv6HTTPServer", BoundHTTPServer),
    ):
        yield


class GlooOn(ProcessGroupGloo):
    """torchft's reconfigurable gloo process group, whose connections to the other groups
    listen and are advertised on `address`: torchft 0.2.0 gives gloo its default device, the
    address ``gethostname()`` resolves to (else loopback, which no other host reaches)."""

    def __init__(self, address: Address, timeout: timedelta):
        super().__init__(timeout=timeout)
        self._address = address

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """torchft's process group of a new quorum, its gloo backend on `address`."""
        options = BaseProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in stubs
        options._timeout = self._timeout
        options._devices = [BaseProcessGroupGloo.create_device(hostname=self._address.ip)]

        def gloo(store: Any, rank: int, size: int, _timeout: Any) -> Any:
            return BaseProcessGroupGloo(store, rank, size, options)

        with _replaced(torchft_process_group, "BaseProcessGroupGloo", gloo):
            return super()._create_pg(store, rank, world_size)
