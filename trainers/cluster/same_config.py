"""Every process of a run must train the same config: checked once, right after the join.

Each process is started with its own command line, so nothing stops one from getting another
``optimizer.learning_rate`` (it would train silently, its gradients averaged with the
others') or another ``trainer.steps`` (one process would stop early, the other would then
wait in a collective until gloo or JAX aborts it). `check_same_config` compares the resolved,
flattened configs of all processes (`trainers.config.plain.flat_config`, made by the app)
through JAX's key-value store (`trainers.cluster.multihost.Cluster`), before any step: a
digest of each flattened config first (one small entry per process); only when the digests
differ, every process's flattened ``key: [digest, value]`` entries, so that every process
refuses with the same one line naming the keys that differ and each process's value
(`ConfigError`, exit status 2).

Keys that legitimately differ between processes are left out
(`trainers.config.plain.PER_PROCESS`). Elastic replica groups, each its own run, swap their
entries through a torchft quorum's store instead (`swap_configs`,
`trainers.cluster.torchft_group`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from trainers.cluster.multihost import Cluster
from trainers.config.plain import PER_PROCESS
from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: At most this many differing keys are named in the message (then "and N more").
MAX_KEYS_SHOWN = 5
#: A value longer than this is elided in the message.
MAX_VALUE_SHOWN = 60


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def digest(text: str) -> str:
    """A short hex digest of `text`."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_same_config(cluster: Cluster, flat: Mapping[str, Any]) -> None:
    """Refuses to start unless every process has the same config (less `PER_PROCESS`).

    Call it on every process at the same point of start-up, after the join and before any
    step. One process: nothing to compare.

    Args:
      cluster: the run's processes.
      flat: this process's config, flattened (`trainers.config.plain.flat_config`: resolved,
        less `PER_PROCESS`).

    Raises:
      ConfigError: on every process alike, naming the differing keys and each process's
        value (exit status 2).
    """
    if cluster.count == 1:
        return
    digests = cluster.all_gather("config/digest", config_digest(flat))
    if len(set(digests)) == 1:
        return
    everyone = cluster.all_gather("config/entries", config_entries(flat))
    raise ConfigError(differences_message(everyone))


def config_digest(flat: Mapping[str, Any]) -> str:
    """The digest of a flattened config (equal digests: equal configs)."""
    return digest(_encode({key: _encode(value) for key, value in flat.items()}))


def config_entries(flat: Mapping[str, Any]) -> dict[str, list[str]]:
    """A flattened config as ``{key: [digest of its value, its value as shown]}``, what
    `listed_differences` compares (JSON-able, short)."""
    return {
        key: [digest(_encode(value)), shown(value, MAX_VALUE_SHOWN)] for key, value in flat.items()
    }


def differences_message(everyone: list[dict[str, list[str]]]) -> str:
    """The one line naming the keys whose ``[digest, shown value]`` differ between processes.

    Args:
      everyone: per process (in process order), its ``{key: [digest, shown value]}``.
    """
    listed = listed_differences(everyone, range(len(everyone)), "process")
    left_out = ", ".join(f"{k}.*" if k == "paths" else k for k in PER_PROCESS)
    return (
        f"The processes of this run were given different configs: {listed}. Every process "
        f"must run the same config (all but {left_out}): start them all with the same "
        "overrides."
    )


def listed_differences(
    everyone: Sequence[Mapping[str, list[str]]], ids: Sequence[int], noun: str
) -> str:
    """The keys whose ``[digest, shown value]`` differ between `everyone`'s configs, each with
    its values and who has them (``optimizer.learning_rate (0.1 on group 0, 0.2 on group 1)``).

    Args:
      everyone: per member, its `config_entries`.
      ids: the members' ids, in the same order.
      noun: what a member is called (``process``, ``group``).
    """
    keys = sorted(set().union(*everyone))
    differing = []
    for key in keys:
        seen = [entries.get(key) for entries in everyone]
        if len({None if s is None else s[0] for s in seen}) > 1:
            differing.append((key, seen))
    parts = []
    for key, seen in differing[:MAX_KEYS_SHOWN]:
        groups: dict[str, list[int]] = {}
        for i, entry in zip(ids, seen, strict=True):
            groups.setdefault("(not set)" if entry is None else entry[1], []).append(i)
        values = ", ".join(f"{value} on {_members(who, noun)}" for value, who in groups.items())
        parts.append(f"{key} ({values})")
    more = len(differing) - MAX_KEYS_SHOWN
    return "; ".join(parts) + (f"; and {more} more keys" if more > 0 else "")


def _members(indices: list[int], noun: str) -> str:
    """``process 0``, ``processes 1, 3``, ``processes 0-5, 7`` (or ``group ...``)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    plural = f"{noun}es" if noun.endswith("s") else f"{noun}s"
    return f"{noun} {text}" if len(indices) == 1 else f"{plural} {text}"


class ConfigEntry(NamedTuple):
    """What each process of a group writes in a quorum's store when the groups' configs
    differ: its group's process count and flattened config (`config_entries`)."""

    processes: int
    config: Any


class StoreSeat(NamedTuple):
    """Which store of a quorum a process uses. torchft 0.2.0 gives rank `rank` of every group
    the store of the ``rank % stores``-th group at the quorum's highest step, `stores` being
    their number (``max_world_size``): so every group's ranks ``r = rank (mod stores)`` read
    the same store."""

    rank: int
    stores: int

    def readers(self, entries: list[ConfigEntry]) -> int:
        """How many processes read this store: those ranks of every group (`entries`, one a
        group)."""
        return sum(len(range(self.rank % self.stores, e.processes, self.stores)) for e in entries)


def swap_configs(
    store: Any,
    prefix: str,
    me: str,
    mine: ConfigEntry,
    members: list[str],
    seat: StoreSeat,
    timeout: timedelta,
) -> list[ConfigEntry]:
    """Every member's `ConfigEntry` through `store` (keys under `prefix`; `me`: this group's
    replica id, among `members`). Returns once every process reading the store has read
    (`StoreSeat.readers`: with groups of several processes, more than one a group), or after
    `timeout`: the store's host may exit next (a group refused at its join), and a process
    that read nothing yet would meet no store.
    """
    store.set(prefix + me, json.dumps(mine))
    everyone = [ConfigEntry(*json.loads(store.get(prefix + r))) for r in members]
    store.add(prefix + "read", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(prefix + "read", 0) < seat.readers(everyone) and time.monotonic() < deadline:
        time.sleep(0.05)
    return everyone
