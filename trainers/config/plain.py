"""The composed config as plain values, for the wings that must not read it (only
`trainers.app` does): the run's config stored in each checkpoint (`run_config`) and the
flattened config the processes of a run compare (`flat_config`,
`trainers.cluster.same_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from xshard.config.elastic_groups import STANDBY_FLAG

#: Keys left out of the comparison of the processes' configs, and why:
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
#: - ``reduction.axes.<axis>.elastic.host``: the address this process's torchft manager,
#:   checkpoint server and gloo connections listen on and advertise to the other groups, its
#:   own host's in a group of processes on several hosts (the group's store is its process
#:   0's, whose address the others receive).
#: - ``reduction.axes.<axis>.elastic.standby``: set on a group's warm standby only (a process
#:   of its own, `trainers.cluster.standby`), which runs the group's config and, once it takes
#:   over, is the group's run: its checkpoints are the group's, resumed by a plain restart.
#:
#: A ``*`` matches any one name (`fnmatch`), such as an axis.
PER_PROCESS = (
    "distributed.process_id",
    "distributed.coordinator_address",
    "paths",
    "trainer.progress",
    "trainer.resume_from",
    "reduction.axes.*.elastic.host",
    f"reduction.axes.*.{STANDBY_FLAG}",
)
#: Keys that may differ between the replica groups of an elastic job, besides the elastic node
#: itself (its ``group``, ``host`` and timeouts) and `PER_PROCESS`: ``trainer.hooks`` observe a
#: run (a hook may write to a folder named after the group) and do not change what it trains.
#: Every other key must be equal, or a joining group is refused
#: (`trainers.app.elastic_group.group_config`).
PER_GROUP = ("trainer.hooks",)


def run_config(cfg: DictConfig) -> dict[Any, Any]:
    """The run's resolved config as plain JSON-able values, without the machine-local `paths`."""
    return {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in ((k, cfg[k]) for k in cfg if k != "paths")
    }


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
            if under(path, PER_PROCESS):
                continue
            try:
                value = node[key]
            except Exception:  # unresolvable here: compare what was written
                value = _raw(node, key)
            if isinstance(value, DictConfig):
                walk(value, f"{path}.")
                continue
            if isinstance(value, ListConfig):
                try:
                    value = OmegaConf.to_container(value, resolve=True)
                except Exception:  # unresolvable: the list as written
                    value = OmegaConf.to_container(value, resolve=False)
            flat[path] = value

    if OmegaConf.is_dict(cfg):
        walk(cfg, "")
    else:
        walk(OmegaConf.create(cfg), "")
    return flat


def under(path: str, keys: Iterable[str]) -> bool:
    """Whether the dotted `path` is one of `keys` or under one (``paths`` covers
    ``paths.output_dir``); a ``*`` in a key matches any name (`fnmatch`)."""
    return any(fnmatchcase(path, key) or fnmatchcase(path, f"{key}.*") for key in keys)


def _raw(node: DictConfig, key: Any) -> str:
    try:
        child = node._get_node(key)
        if child is not None and child._is_missing():
            return "???"
        return str(child._value()) if child is not None else "<unreadable>"
    except Exception:  # whatever OmegaConf raises: not comparable
        return "<unreadable>"
