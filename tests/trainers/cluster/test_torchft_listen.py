"""Where a replica group's servers listen (`trainers.cluster.torchft_listen`): real torch
``TCPStore``, real torchft manager server, lighthouse and checkpoint server, in this process on
127.0.0.1 (the sockets read from ``/proc/self/net``). Cheap: no subprocess; the same on two
emulated hosts is in test_elastic_hosts_cli.py."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torchft.checkpointing.http_transport as http_transport
import torchft.manager as torchft_manager
from torchft._torchft import LighthouseServer

from tests.multihost_cli import listening
from trainers.cluster.torchft_listen import Address, resolve, servers_on, tcp_store
from xshard.errors import ConfigError

KEY = "reduction.axes.slice.elastic"
LOOPBACK = Address("127.0.0.1", socket.AF_INET)


def test_the_store_the_manager_server_and_the_checkpoint_server_listen_on_the_host_only():
    before = listening(os.getpid())
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = tcp_store(resolve("127.0.0.1", KEY))
    assert store.port != 0
    names = torchft_manager.ManagerServer, http_transport._IPv6HTTPServer
    with servers_on(LOOPBACK):
        manager = torchft_manager.ManagerServer(
            replica_id="group_0",
            lighthouse_addr=lighthouse.address(),
            hostname="127.0.0.1",
            bind="[::]:0",  # what torchft 0.2.0 asks for: every interface
            store_addr=f"127.0.0.1:{store.port}",
            world_size=1,
            heartbeat_interval=timedelta(seconds=0.1),
            connect_timeout=timedelta(seconds=5),
            quorum_retries=0,
        )
        transport = http_transport.HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
    try:
        assert (torchft_manager.ManagerServer, http_transport._IPv6HTTPServer) == names
        opened = listening(os.getpid()) - before
        ports = {int(manager.address().rsplit(":", 1)[1]), store.port}
        ports.add(transport._server.socket.getsockname()[1])
        lighthouse_port = int(lighthouse.address().rsplit(":", 1)[1])
        assert opened == {("127.0.0.1", p) for p in (*ports, lighthouse_port)}, opened
    finally:
        transport.shutdown(wait=False)
        manager.shutdown()
        lighthouse.shutdown()


@pytest.mark.parametrize(
    "host, reason",
    [("192.0.2.1", "Cannot assign requested address"), ("no-such-host.invalid", "")],
)
def test_a_host_this_process_cannot_listen_on_is_one_line_naming_the_key(host, reason):
    with pytest.raises(ConfigError) as error:
        resolve(host, KEY)
    message = str(error.value)
    assert message.startswith(f"{KEY}.host={host}: this process cannot listen there ("), message
    assert reason in message and "\n" not in message
