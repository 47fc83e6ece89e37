"""The ``elastic`` node of a periodic axis: its replicas are replica groups on torchft.

``reduction.axes.<axis>.elastic`` (null: off) makes the periodic axis *elastic*: each replica
group is its own run (one process or a ``jax.distributed`` job of several, its own mesh and run
dir, the axis of size 1 in it), and at
each sync the pseudo-gradient is averaged over the groups in torchft's quorum
(`trainers.cluster.torchft_group`). A group that dies does not stop the others; a (re)started group
receives the state from a live peer. docs/reductions.md ("Elastic replica groups").

The keys, their defaults and their ranges are written once, here (`ElasticConf`,
`ELASTIC_RANGES`, `check_elastic`); ``lighthouse`` and ``host`` are network locations
(`xshard.config.nodes.LOCATION`): a config file that is not trusted may not set them
(`trainers.app.trust`). JAX-free, like every schema.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from xshard.config.nodes import LOCATION, shown
from xshard.config.ranges import Range
from xshard.errors import ConfigError

#: Where the lighthouse listens unless told otherwise (torchft's port, this host only).
DEFAULT_LIGHTHOUSE = "127.0.0.1:29510"
#: The key of a group's warm standby flag under its axis (left out of run names: the standby
#: writes to its group's TensorBoard run).
STANDBY_FLAG = "elastic.standby"
#: ``host:port`` of the lighthouse (``http://`` optional): a host name or IPv4 address.
_ADDRESS = re.compile(r"^(?:http://)?([A-Za-z0-9.\-]+):([0-9]{1,5})$")
#: What an elastic axis does not support yet (its key, the value that means "off").
UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("fragments", 1),
    ("sync_delay", 0),
    ("mix", 0.0),
    ("comm_dtype", None),
    ("error_feedback", False),
    ("warmup_steps", 0),
)


@dataclass
class ElasticConf:
    """The node ``reduction.axes.<axis>.elastic``: this process's replica group on torchft.

    Attributes:
      group: this group's id (0, 1, ...; unique in the job): the replica id torchft sees, and
        the data seed's second part (the data of a group is a function of (seed, group, step)).
      lighthouse: ``host:port`` of torchft's lighthouse (the quorum server).
      host: this process's host (a name or address): where its store, manager server,
        checkpoint server and gloo connections listen, and what they advertise to its peers.
      min_groups: the fewest groups a sync commits with (torchft's ``min_replica_size``).
      heartbeat_s: seconds between this group's heartbeats to the lighthouse.
      timeout_s: seconds a collective, a commit vote or a state transfer may take.
      quorum_timeout_s: seconds a sync waits for its quorum (longer than a period of inner
        steps of the slowest group: a joining group waits there for the others' next sync).
      connect_timeout_s: seconds to connect to the lighthouse and the peers.
      max_retries: syncs in a row that may fail to commit (each retried with the new quorum)
        before the group stops (exit 4).
      quorum_retries: times a quorum request is retried when the lighthouse cannot be reached
        (torchft's ``quorum_retries``; a lighthouse killed and restarted): with 0 a group waits
        for its quorum until ``quorum_timeout_s``.
      standby: this process is its group's warm standby (``python -m trainers.elastic run
        --standby`` starts it): it builds and compiles the run, then waits for its
        supervisor's go on stdin and only then opens the group's run dir and joins
        (`trainers.cluster.standby`).
    """

    group: Any = None
    lighthouse: str = dataclasses.field(default=DEFAULT_LIGHTHOUSE, metadata=LOCATION)
    host: str = dataclasses.field(default="127.0.0.1", metadata=LOCATION)
    min_groups: Any = 1
    heartbeat_s: Any = 0.1
    timeout_s: Any = 60.0
    quorum_timeout_s: Any = 600.0
    connect_timeout_s: Any = 60.0
    max_retries: Any = 3
    quorum_retries: Any = 30
    standby: Any = False


#: The numeric keys and their ranges (the one place they are written).
ELASTIC_RANGES: dict[str, Range] = {
    "group": Range("this replica group's id", 0, 1_000_000, integer=True),
    "min_groups": Range("the fewest groups a sync commits with", 1, integer=True),
    "heartbeat_s": Range("seconds between heartbeats", 0, 60, low_open=True, high_closed=True),
    "timeout_s": Range("seconds a collective or a state transfer may take", 0, low_open=True),
    "quorum_timeout_s": Range("seconds a sync waits for its quorum", 0, low_open=True),
    "connect_timeout_s": Range("seconds to connect", 0, low_open=True),
    "max_retries": Range("syncs in a row that may fail to commit", 0, integer=True),
    "quorum_retries": Range("retries of a quorum the lighthouse did not answer", 0, integer=True),
}


def lighthouse_url(address: str) -> str:
    """The lighthouse's URL as torchft takes it (``http://host:port``)."""
    return address if address.startswith("http://") else f"http://{address}"


def check_elastic(node: Any, key: str, rule: Any) -> None:
    """Checks the ``elastic`` node of one axis (its ranges, the lighthouse address, and that
    the axis's `rule` is periodic and uses nothing an elastic axis does not support yet).

    Args:
      node: the node read as `ElasticConf` (or None: off, nothing checked).
      key: its key, ``reduction.axes.<axis>.elastic``.
      rule: the axis's node (`xshard.config.axes.AxisReductionConf`).

    Raises:
      ConfigError: one line naming the first bad key, its value and what is allowed.
    """
    if node is None:
        return
    axis = key.rsplit(".", 1)[0]
    if rule.outer_optimizer is None:
        raise ConfigError(
            f"{key}: an elastic axis is a periodic one; set {axis}.outer_optimizer (its groups "
            "average their pseudo-gradient at each sync), or set elastic=null."
        )
    for name, off in UNSUPPORTED:
        value = getattr(rule, name)
        if value != off:
            raise ConfigError(
                f"{axis}.{name}={shown(value)}: not supported with {key} yet (docs/reductions.md, "
                f"'Elastic replica groups'); set {axis}.{name}={shown(off)} or elastic=null."
            )
    if node.group is None:
        raise ConfigError(
            f"{key}.group=None: expected this replica group's id, an integer >= 0 (unique in "
            f"the job), e.g. {key}.group=0."
        )
    for name, allowed in ELASTIC_RANGES.items():
        allowed.check(getattr(node, name), f"{key}.{name}")
    found = _ADDRESS.match(node.lighthouse) if isinstance(node.lighthouse, str) else None
    if found is None or not 0 < int(found.group(2)) < 65536:
        raise ConfigError(
            f"{key}.lighthouse={shown(node.lighthouse)}: expected the lighthouse's host:port "
            "(port 1 to 65535), e.g. 127.0.0.1:29510."
        )
    if not isinstance(node.standby, bool):
        raise ConfigError(
            f"{key}.standby={shown(node.standby)}: expected true (this process is the group's "
            "warm standby, started by python -m trainers.elastic run --standby) or false."
        )
    if not isinstance(node.host, str) or not re.fullmatch(r"[A-Za-z0-9.\-:]+", node.host):
        raise ConfigError(
            f"{key}.host={shown(node.host)}: expected the host name or address this group "
            "advertises to its peers, e.g. 127.0.0.1."
        )
