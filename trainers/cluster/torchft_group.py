"""A replica group on torchft: the `trainers.core.periodic.group_sync.Exchange` of an elastic axis.

Each group (one process) runs a torchft ``Manager`` (replica id ``group_<id>``) with its own
``TCPStore`` and a reconfigurable gloo process group. A round (`TorchftExchange.round`):

1. ``start_quorum``: the lighthouse forms the quorum of the groups that ask (those whose
   heartbeats stopped for its timeout are dropped); a group behind the others (fewer committed
   syncs) is *healed*: it fetches a live peer's `GroupState` over HTTP and sends zeros;
2. ``allreduce`` (a sum) of ``[weight * delta, weight]``: the mean is the first part over the
   second, the pseudo-gradient averaged over the groups weighted by what each sent (1 a group
   that trained since the last sync; 0 one joining). Every group divides the same sum, so every
   group gets the same mean, bit for bit;
3. ``should_commit``: the group votes; a round whose collective failed (a peer died in it) is
   not committed and is retried with the new quorum, up to ``max_retries`` times in a row.

torch and torchft are imported by this module only, which the app imports only for an elastic
axis (the optional extra ``xshard[elastic]``). The state transfer is pickle over HTTP: groups
must trust each other (docs/reliability.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from trainers.core.periodic.group_sync import GroupState, Round
from trainers.exits import GroupLost
from xshard.config.elastic_groups import lighthouse_url

log = logging.getLogger(__name__)


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


class TorchftExchange:
    """This group's torchft manager, as an `Exchange` (module docstring).

    Args:
      options: the group's options.
      axis_key: ``reduction.axes.<axis>.elastic``, for messages.
    """

    def __init__(self, options: GroupOptions, axis_key: str):
        torch.set_num_threads(1)  # the devices are JAX's; torch only sums a vector
        self.options, self.key = options, axis_key
        self._snapshot: Callable[[], GroupState] | None = None
        self._healed: GroupState | None = None
        seconds = lambda s: timedelta(seconds=s)
        self._store = dist.TCPStore(options.host, 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=seconds(options.timeout_s)),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=options.min_groups,
            timeout=seconds(options.timeout_s),
            quorum_timeout=seconds(options.quorum_timeout_s),
            connect_timeout=seconds(options.connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=options.host,
            store_port=self._store.port,
            lighthouse_addr=lighthouse_url(options.lighthouse),
            replica_id=f"group_{options.group}",
            hostname=options.host,
            heartbeat_interval=seconds(options.heartbeat_s),
            checkpoint_transport=_Transport(options.host, seconds(options.timeout_s)),
            init_sync=False,  # every group starts from the same seed's params
        )

    def _state(self) -> GroupState:
        """torchft's state_dict: this group's state at the round's start (for a healing peer)."""
        assert self._snapshot is not None, "a peer asked for the state outside a round"
        return self._snapshot()

    def _load(self, state: GroupState) -> None:
        """torchft's load_state_dict: a live peer's state, used when the round commits."""
        self._healed = GroupState(*state)

    def round(self, delta: np.ndarray, weight: float, snapshot: Callable[[], GroupState]) -> Round:
        """One committed round (module docstring): the mean of the groups' deltas weighted by
        their `weight` (None when the weights sum to 0) and the peer state loaded, if any.

        Raises:
          GroupLost: after ``max_retries + 1`` rounds in a row that did not commit.
        """
        manager, healed = self.manager, None
        message = np.append(np.asarray(delta, np.float32) * np.float32(weight), np.float32(weight))
        if not weight:
            log.info(
                "Group %d joining its peers (waiting for their next sync).", self.options.group
            )
        for attempt in range(self.options.max_retries + 1):
            self._snapshot, self._healed = snapshot, None
            manager.start_quorum()
            tensor = torch.from_numpy(message.copy())
            manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()
            committed = manager.should_commit()
            healed = self._healed or healed  # loaded before the vote, whatever it says
            if committed:
                total = tensor.numpy()
                if healed is not None:
                    log.info(
                        "Group %d rejoined at step %d from a live peer.",
                        self.options.group,
                        healed.step,
                    )
                mean = None if total[-1] == 0 else total[:-1] / total[-1]
                return Round(mean, healed)
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

    def close(self) -> None:
        """Stops the manager's servers (this group leaves the quorum)."""
        self.manager.shutdown(wait=False)


def group_seed(seed: int, group: int) -> int:
    """The data seed of `group`: a pure function of (``seed``, group), so each group trains on
    its own data and a restarted group resumes the same stream from its step."""
    return int(np.random.SeedSequence([seed, group]).generate_state(1)[0])
