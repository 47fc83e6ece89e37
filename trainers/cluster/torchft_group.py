"""A replica group on torchft: the `trainers.core.periodic.group_sync.Exchange` of an elastic axis.

Each process of a group runs a torchft ``Manager`` of its rank (replica id ``group_<id>``;
torchft pairs rank r of every group in its reconfigurable gloo process group), the group's
``TCPStore`` hosted by its process 0. A round (`TorchftExchange.round`), in every process on
its piece of the vectors:

1. ``start_quorum``: the lighthouse forms the quorum of the groups that ask (those whose
   heartbeats stopped for its timeout are dropped); a group behind the others (fewer committed
   syncs) is *healed*: it fetches a live peer's `GroupState` over HTTP and sends zeros;
2. ``allreduce`` (a sum) of ``[weight * delta, weight]``: the mean is the first part over the
   second, the pseudo-gradient averaged over the groups weighted by what each sent (1 a group
   that trained since the last sync; 0 one joining). Every group divides the same sum, so every
   group gets the same mean, bit for bit;
3. ``should_commit``: the group votes; a round whose collective failed (a peer died in it) is
   not committed and is retried with the new quorum, up to ``max_retries`` times in a row.

A stop signal (the run's `trainers.cluster.preemption.StopOnSignal`) only sets a flag, which
the main thread would see only once a wait of torchft's returns: a group of one process polls
it while it waits for its quorum or its collective and leaves the round at once (`round`
returns None; the group stops as any preempted run, with its state from before the sync).

torch and torchft are imported by this module only (and `trainers.cluster.torchft_listen`, which
makes the group's store, manager server, checkpoint server and gloo connections listen on
``elastic.host`` only), which the app imports only for an elastic axis (the optional extra
``xshard[elastic]``). The state transfer is pickle over HTTP: groups must trust each other
(docs/reliability.md).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.manager import REPLICA_ID_KEY, Manager

from trainers.cluster.multihost import Cluster
from trainers.cluster.same_config import (
    ConfigEntry,
    StoreSeat,
    config_digest,
    config_entries,
    listed_differences,
    swap_configs,
)
from trainers.cluster.standby import JOINING
from trainers.cluster.torchft_listen import Address, GlooOn, resolve, servers_on, tcp_store
from trainers.core.periodic.group_sync import GroupState, Round
from trainers.exits import GroupLost
from xshard.config.elastic_groups import lighthouse_url
from xshard.errors import ConfigError

log = logging.getLogger(__name__)

#: A group's replica id at the lighthouse: its config's digest and its id (torchft appends
#: ``:<uuid>`` and takes the trailing digits before it as the group's rank).
_REPLICA_ID = re.compile(r"^cfg-([0-9a-f]+)-group_([0-9]+):")
#: Seconds between two looks at the run's stop request while a round waits for torchft.
STOP_POLL_S = 0.1


class RoundLeft(Exception):
    """A stop request came while a round waited for its quorum or its collective
    (`wait_unless_stopped`)."""


class GroupOptions(NamedTuple):
    """This group's ``reduction.axes.<axis>.elastic`` node, as plain values
    (`xshard.config.elastic_groups.ElasticConf`, whose docstring says what each means)."""

    group: int
    lighthouse: str
    host: str
    min_groups: int
    heartbeat_s: float
    timeout_s: float
    quorum_timeout_s: float
    connect_timeout_s: float
    max_retries: int
    quorum_retries: int


class _Transport(HTTPTransport):
    """torchft's HTTP checkpoint server, advertising the configured host rather than
    ``socket.gethostname()``."""

    def __init__(self, host: str, timeout: timedelta):
        self._host = host  # before the server starts: it logs its address
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        """Where a peer fetches this group's state (``/checkpoint/<step>`` appended)."""
        port = self._server.socket.getsockname()[1]
        return f"http://{self._host}:{port}/checkpoint/"


class _FirstLine(logging.Filter):
    """Keeps the first line of each record of torchft's manager: it logs a collective that
    failed (a peer died in it) with the traceback, twice; the round is not committed and is
    retried, which this module says in one warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = record.getMessage().split("\n", 1)[0], None
        record.exc_info = record.exc_text = None
        return True


class _QuorumSeen:
    """torchft's ``ManagerClient``, keeping the last quorum it returned (its members' replica
    ids and store address), which torchft 0.2.0's ``Manager`` does not expose."""

    def __init__(self, client: Any):
        self._client = client
        self.last: Any = None

    def _quorum(self, **kwargs: Any) -> Any:
        self.last = self._client._quorum(**kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TorchftExchange:
    """This group's torchft manager, as an `Exchange` (module docstring).

    Args:
      options: the group's options.
      axis_key: ``reduction.axes.<axis>.elastic``, for messages.
      config: the group's flattened config, less what may differ between groups (compared
        with its peers' at each new quorum: `_check_peers`).
      cluster: the group's processes (`jax.distributed`); each runs a manager of its rank,
        process 0 hosts the group's store and learns its address to the others.
      stop: the run's stop request (`trainers.cluster.preemption.StopOnSignal`): a group of
        one process leaves a round that waits when it comes (`round`). A group of several
        ignores it in a round (its processes could leave it at different points) and stops
        after the round, as before.
    """

    def __init__(
        self,
        options: GroupOptions,
        axis_key: str,
        config: Mapping[str, Any],
        cluster: Cluster,
        stop: Callable[[], object],
    ):
        torch.set_num_threads(1)  # the devices are JAX's; torch only sums a vector
        self.options, self.key, self.config = options, axis_key, config
        self._snapshot: Callable[[], GroupState] | None = None
        self._healed: GroupState | None = None
        self._checked: Any = None  # the last quorum whose members were checked
        self._quiet = _FirstLine()
        self._stop = stop if cluster.count == 1 else lambda: False
        self._rank, self._processes = cluster.index, cluster.count
        logging.getLogger("torchft.manager").addFilter(self._quiet)
        address = resolve(options.host, axis_key)  # every server listens there only
        self._store = tcp_store(address) if cluster.lead else None  # else process 0's:
        store_host, store_port = cluster.broadcast(  # its address learnt here
            "elastic/store", [options.host, 0 if self._store is None else self._store.port]
        )
        with servers_on(address):
            self.manager = self._manager(address, config, cluster, (store_host, store_port))
        self._seen = self.manager._client = _QuorumSeen(self.manager._client)  # torchft 0.2.0
        self.replica_id = self.manager._store.get(REPLICA_ID_KEY).decode()  # with its uuid

    def _manager(
        self, address: Address, config: Mapping[str, Any], cluster: Cluster, store: tuple[str, int]
    ) -> Manager:
        """This process's torchft manager (its server in process 0 only), its gloo
        connections on `address`; `store`: the group's store (host, port)."""
        options, seconds = self.options, lambda s: timedelta(seconds=s)
        return Manager(
            pg=GlooOn(address, seconds(options.timeout_s)),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=options.min_groups,
            timeout=seconds(options.timeout_s),
            quorum_timeout=seconds(options.quorum_timeout_s),
            connect_timeout=seconds(options.connect_timeout_s),
            rank=cluster.index,
            world_size=cluster.count,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=lighthouse_url(options.lighthouse),
            replica_id=f"cfg-{config_digest(config)[:16]}-group_{options.group}",
            hostname=options.host,
            heartbeat_interval=seconds(options.heartbeat_s),
            checkpoint_transport=_Transport(options.host, seconds(options.timeout_s)),
            quorum_retries=options.quorum_retries,  # a lighthouse restarted: the groups go on
            init_sync=False,  # every group starts from the same seed's params
        )

    def _state(self) -> GroupState:
        """torchft's state_dict: this group's state at the round's start (for a healing peer)."""
        assert self._snapshot is not None, "a peer asked for the state outside a round"
        return self._snapshot()

    def _load(self, state: GroupState) -> None:
        """torchft's load_state_dict: a live peer's state, used when the round commits."""
        self._healed = GroupState(*state)

    def round(
        self, delta: np.ndarray, weight: float, snapshot: Callable[[], GroupState]
    ) -> Round | None:
        """One committed round (module docstring): the mean of the groups' deltas weighted by
        their `weight` (None when the weights sum to 0) and the peer state loaded, if any.
        None: a stop request came while the round waited (`wait_unless_stopped`); the round is
        left, committed by no one here (its peers' fails and is retried without this group).

        Raises:
          GroupLost: after ``max_retries + 1`` rounds in a row that did not commit.
        """
        healed = None
        message = np.append(np.asarray(delta, np.float32) * np.float32(weight), np.float32(weight))
        if not weight:
            log.info("Group %d %s (waiting for their next sync).", self.options.group, JOINING)
        for attempt in range(self.options.max_retries + 1):
            self._snapshot, self._healed = snapshot, None
            try:
                total = self._attempt(message, joining=not weight)
            except RoundLeft:
                return None
            healed = self._healed or healed  # loaded before the vote, whatever it says
            if total is not None:
                if healed is not None:
                    log.info(
                        "Group %d rejoined at step %d from a live peer.",
                        self.options.group,
                        healed.step,
                    )
                mean = None if total[-1] == 0 else total[:-1] / total[-1]
                return Round(mean, healed, float(total[-1]))
            log.warning(
                "Group %d: sync not committed (attempt %d of %d); retrying with the new quorum.",
                self.options.group,
                attempt + 1,
                self.options.max_retries + 1,
            )
        raise GroupLost(
            f"{self.key}.max_retries={self.options.max_retries}: {self.options.max_retries + 1} "
            "syncs in a row did not commit (peers lost or unreachable); the group stops."
        )

    def _attempt(self, message: np.ndarray, joining: bool) -> np.ndarray | None:
        """One try of a round: the quorum, the sum of `message` over it, the vote. The sum if
        the round committed, else None.

        Raises:
          RoundLeft: a stop request came while it waited for its quorum or its collective.
        """
        manager = self.manager
        manager.start_quorum()
        wait_unless_stopped(manager.wait_quorum, self._stop)
        self._check_peers(joining=joining)
        tensor = torch.from_numpy(message.copy())
        summed = manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
        wait_unless_stopped(summed.wait, self._stop)
        return tensor.numpy() if manager.should_commit() else None

    def _check_peers(self, joining: bool) -> None:
        """Checks a new quorum's members: no other group with this group's id, and every
        group's config digest equal to this one's (else the groups swap their configs through
        the quorum's store, and each names the keys that differ). A joining group is refused;
        one that was there logs the same line and goes on (its round with the refused group
        fails and is retried without it).

        Raises:
          ConfigError: while joining, one line naming the key and the id, or the keys that
            differ and each group's value.
        """
        quorum = self._seen.last
        if quorum is None or quorum.quorum_id == self._checked:
            return
        self._checked = quorum.quorum_id
        members = {r: _REPLICA_ID.match(r) for r in quorum.replica_ids}
        ids = {r: int(m.group(2)) if m else -1 for r, m in members.items()}
        twins = [r for r, g in ids.items() if g == self.options.group and r != self.replica_id]
        problem = None
        if twins:
            problem = (
                f"{self.key}.group={self.options.group}: {len(twins) + 1} groups in the quorum "
                "claim this id; give each group its own id (0, 1, ...)."
            )
        elif len({m.group(1) if m else r for r, m in members.items()}) > 1:
            problem = self._config_differences(quorum, ids)
        if problem is None:
            return
        if joining:
            raise ConfigError(problem)
        log.warning(
            "%s The group joining is refused; group %d goes on.", problem, self.options.group
        )

    def _config_differences(self, quorum: Any, ids: dict[str, int]) -> str:
        """The groups' configs swapped through the quorum's store (every process of every
        member does it: they all saw the digests differ); the line naming the keys that
        differ."""
        host, port = quorum.store_address.rsplit(":", 1)
        timeout = timedelta(seconds=self.options.timeout_s)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        mine = ConfigEntry(self._processes, config_entries(self.config))
        where = StoreSeat(self._rank, quorum.max_world_size)
        prefix = f"xshard/config/{quorum.quorum_id}/"
        everyone = swap_configs(store, prefix, self.replica_id, mine, list(ids), where, timeout)
        listed = listed_differences([e.config for e in everyone], list(ids.values()), "group")
        return (
            f"{self.key}: the groups run different configs: {listed}. Every group must run "
            "the same config but the keys left out of this check (docs/reductions.md)."
        )

    def close(self) -> None:
        """Stops the manager's servers (this group leaves the quorum)."""
        self.manager.shutdown(wait=False)
        logging.getLogger("torchft.manager").removeFilter(self._quiet)


def wait_unless_stopped(wait: Callable[[], object], stop: Callable[[], object]) -> None:
    """Runs `wait` (a blocking call of torchft's) in a daemon thread and looks at `stop` every
    `STOP_POLL_S` meanwhile: a signal handler only sets a flag, and the main thread would
    otherwise see it only when the quorum (up to ``quorum_timeout_s``) or the collective
    (``timeout_s``) returns. `wait`'s error is raised here.

    Raises:
      RoundLeft: `stop()` was true first (or already); the thread is left to end with its
        call or with the process.
    """
    if stop():
        raise RoundLeft
    failed: list[BaseException] = []  # the thread's error, raised here
    finished = threading.Event()

    def run() -> None:
        try:
            wait()
        except BaseException as e:
            failed.append(e)
        finally:
            finished.set()

    threading.Thread(target=run, name="xshard-round-wait", daemon=True).start()
    # Event.wait, not SimpleQueue.get(timeout=): on CPython 3.11 a signal handled during the
    # latter's timed wait leaves it waiting for good (seen: the poll never came back).
    while not finished.wait(STOP_POLL_S):
        if stop():
            raise RoundLeft
    if failed:
        raise failed[0]


def group_seed(seed: int, group: int) -> int:
    """The data seed of `group`: a pure function of (``seed``, group), so each group trains on
    its own data and a restarted group resumes the same stream from its step."""
    return int(np.random.SeedSequence([seed, group]).generate_state(1)[0])
