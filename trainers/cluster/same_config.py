"""Every process of a run must train the same config: checked once, right after the join.

Each process is started with its own command line, so nothing stops one from getting another
``optimizer.learning_rate`` (it would train silently, its gradients averaged with the
others') or another ``trainer.steps`` (one process would stop early, the other would then
wait in a collective until gloo or JAX aborts it). `check_same_config` compares the resolved
configs of all processes through JAX's key-value store (`trainers.cluster.multihost.Cluster`),
before any step: a digest of each flattened config first (one small entry per process); only
when the digests differ, every process's flattened ``key: [digest, value]`` entries, so that every
process refuses with the same one line naming the keys that differ and each process's value
(`ConfigError`, exit status 2).

Keys that legitimately differ between processes are left out (`PER_PROCESS`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from trainers.cluster.multihost import Cluster
from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: Keys left out of the comparison, and why:
#:
#: - ``distributed.process_id``: differs by definition.
#: - ``distributed.coordinator_address``: one coordinator can be named differently from each
#:   host (``localhost:1234`` on process 0, ``node0:1234`` elsewhere); a wrong one fails the
#:   join itself.
#: - ``paths.*``: each process's own directories (Hydra's timestamped run dir differs between
#:   hosts); process 0's are used by all (`trainers.cluster.run_dirs`), which checks they are
#:   shared.
#: - ``trainer.progress``: only process 0 shows a progress bar.
#: - ``trainer.resume_from``: a path that may be spelled differently on each host (another
#:   mount point, a relative path); what it resolves to must be the same checkpoint on every
#:   process, which `trainers.cluster.run_dirs.check_same_checkpoints` checks.
PER_PROCESS = (
    "distributed.process_id",
    "distributed.coordinator_address",
    "paths",
    "trainer.progress",
    "trainer.resume_from",
)
#: At most this many differing keys are named in the message (then "and N more").
MAX_KEYS_SHOWN = 5
#: A value longer than this is elided in the message.
MAX_VALUE_SHOWN = 60


def flat_config(cfg: Any) -> dict[str, Any]:
    """`cfg` resolved and flattened to ``{"optimizer.learning_rate": 0.001, ...}``.

    Nested nodes become dotted keys; lists are values (resolved, as plain lists). The keys of
    `PER_PROCESS` (and everything under them) are left out. A value whose interpolation cannot
    be resolved here is kept as its unresolved text, a missing value (``???``) as ``"???"``.
    """
    flat: dict[str, Any] = {}

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            path = prefix + format(key)  # as f"{key}" (a bytes key shows as b'...')
            if _per_process(path):
                continue
            try:
                value = node[key]
            except Exception:  # noqa: BLE001 - unresolvable here: compare what was written
                value = _raw(node, key)
            if isinstance(value, DictConfig):
                walk(value, f"{path}.")
                continue
            if isinstance(value, ListConfig):
                try:
                    value = OmegaConf.to_container(value, resolve=True)
                except Exception:  # noqa: BLE001
                    value = OmegaConf.to_container(value, resolve=False)
            flat[path] = value

    if OmegaConf.is_dict(cfg):
        walk(cfg, "")
    else:
        walk(OmegaConf.create(cfg), "")
    return flat


def _per_process(path: str) -> bool:
    return any(path == key or path.startswith(f"{key}.") for key in PER_PROCESS)


def _raw(node: DictConfig, key: Any) -> str:
    try:
        child = node._get_node(key)
        if child is not None and child._is_missing():
            return "???"
        return str(child._value()) if child is not None else "<unreadable>"
    except Exception:  # noqa: BLE001
        return "<unreadable>"


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def digest(text: str) -> str:
    """A short hex digest of `text`."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_same_config(cluster: Cluster, cfg: Any) -> None:
    """Refuses to start unless every process has the same config (less `PER_PROCESS`).

    Call it on every process at the same point of start-up, after the join and before any
    step. One process: nothing to compare.

    Args:
      cluster: the run's processes.
      cfg: this process's composed config.

    Raises:
      ConfigError: on every process alike, naming the differing keys and each process's
        value (exit status 2).
    """
    if cluster.count == 1:
        return
    flat = flat_config(cfg)
    encoded = {key: _encode(value) for key, value in flat.items()}
    mine = digest(_encode(encoded))
    digests = cluster.all_gather("config/digest", mine)
    if len(set(digests)) == 1:
        return
    entries = {
        key: [digest(text), shown(flat[key], MAX_VALUE_SHOWN)] for key, text in encoded.items()
    }
    everyone = cluster.all_gather("config/entries", entries)
    raise ConfigError(differences_message(everyone))


def differences_message(everyone: list[dict[str, list[str]]]) -> str:
    """The one line naming the keys whose ``[digest, shown value]`` differ between processes.

    Args:
      everyone: per process (in process order), its ``{key: [digest, shown value]}``.
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
        for i, entry in enumerate(seen):
            groups.setdefault("(not set)" if entry is None else entry[1], []).append(i)
        values = ", ".join(f"{value} on {_processes(who)}" for value, who in groups.items())
        parts.append(f"{key} ({values})")
    more = len(differing) - MAX_KEYS_SHOWN
    listed = "; ".join(parts) + (f"; and {more} more keys" if more > 0 else "")
    left_out = ", ".join(f"{k}.*" if k == "paths" else k for k in PER_PROCESS)
    return (
        f"The processes of this run were given different configs: {listed}. Every process "
        f"must run the same config (all but {left_out}): start them all with the same "
        "overrides."
    )


def _processes(indices: list[int]) -> str:
    """``process 0``, ``processes 1, 3``, ``processes 0-5, 7``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"process {text}" if len(indices) == 1 else f"processes {text}"
