"""A checkpoint's metadata against the current run: is it xshard's, and does it match?

`check_metadata` refuses metadata of another format (a corrupted checkpoint); `check_compatible`
refuses a checkpoint whose state or `MUST_MATCH_KEYS` differ from the run's, and logs the other
config changes, except the expected ones (`QUIET_KEYS`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainers.checkpoint.save import FORMAT
from trainers.config.plain import PER_GROUP, PER_PROCESS, under
from trainers.config.run import GRAD_IMPL_AUTO
from trainers.config.trainer_schemas import LOCATION_KEYS
from trainers.exits import CheckpointError, CorruptCheckpointError
from xshard.config.targets import ALLOWED_TARGETS_KEY

logger = logging.getLogger(__name__)

#: Config keys that must be equal to resume: the state means something else otherwise.
MUST_MATCH_KEYS = ("task._target_", "optimizer._target_")
#: Config keys whose change on resume is expected and not worth a warning (each with what is
#: under it; a ``*`` matches any name: `trainers.config.plain.under`): besides these, what
#: may differ between the processes of a run and between the groups of an elastic job
#: (`PER_PROCESS`: an elastic group's standby flag among them, `PER_GROUP`: the hooks, what the
#: run logs, which trainers.load and evaluate drop), the locations (`LOCATION_KEYS`: where this
#: machine writes, which a run dir read by `trainers.load` drops) and ``allowed_targets``
#: (what the reading process trusts).
QUIET_KEYS = (
    "checkpoint",
    "logger",
    "distributed",  # the processes that run it: 2x4 devices resume on 1x8 and back
    *PER_PROCESS,
    *PER_GROUP,
    ALLOWED_TARGETS_KEY,
    *LOCATION_KEYS,
)
#: Config keys whose value a run resolves at start-up, and the value that says so: the
#: checkpoint holds what the run resolved (``trainer.grad_impl=auto`` saved as the path it
#: chose), and a run resuming with that value again runs the saved one (`trainers.app.grad_path`).
RESOLVED_KEYS = {"trainer.grad_impl": GRAD_IMPL_AUTO}
_ABSENT = object()


def check_metadata(metadata: Any, path: Path) -> None:
    """Refuses metadata that is not xshard's of `FORMAT`: valid JSON that is not this format's
    metadata is as unusable as unreadable metadata.

    Raises:
      CorruptCheckpointError: naming what was found instead.
    """
    if not isinstance(metadata, Mapping):
        kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}
        problem = f"a JSON {kind.get(type(metadata), 'number')}, not an object"
    elif metadata.get("format") != FORMAT:
        problem = f"format {metadata.get('format', 'absent')!r:.80}"
    else:
        bad = [
            k
            for k in ("signature", "checksums", "config")
            if not isinstance(metadata.get(k), Mapping)
        ]
        if not bad and not all(
            isinstance(leaf, list) and len(leaf) == 2 and isinstance(leaf[0], list)
            for leaf in metadata["signature"].values()
        ):
            bad.append("signature entry")
        if not bad:
            return
        problem = f"format {FORMAT!r} with a malformed {', '.join(bad)}"
    raise CorruptCheckpointError(
        f"Checkpoint {path}: its metadata is not xshard checkpoint metadata of format "
        f"{FORMAT!r} (found {problem})."
    )


def check_compatible(
    metadata: Mapping[str, Any],
    signature: dict[str, list],
    config: dict[str, Any],
    *,
    where: str,
    action: str = "Resuming from",
) -> None:
    """Checks a checkpoint's metadata against the current run.

    Args:
      metadata: the checkpoint's JSON metadata.
      signature: `state_signature` of the current run's state.
      config: the current run's `trainers.config.plain.run_config`.
      where: the checkpoint, for messages.
      action: what the restore is for, in the warning about other config changes.

    Raises:
      CheckpointError: if the state's structure, shapes or dtypes differ, or a
        `MUST_MATCH_KEYS` config value differs; the message lists both.
    """
    saved, now = _flatten(metadata.get("config", {})), _flatten(config)
    changed = {
        k
        for k in saved.keys() | now.keys()
        if saved.get(k, _ABSENT) != now.get(k, _ABSENT)
        and not (k in RESOLVED_KEYS and now.get(k) == RESOLVED_KEYS[k])
    }
    config_diff = [
        f"{k}: {_json(saved.get(k, _ABSENT))} in the checkpoint, {_json(now.get(k, _ABSENT))} now"
        for k in sorted(changed)
        if not under(k, QUIET_KEYS)
    ]
    old = metadata.get("signature", {})
    state_diff = [
        f"{p}: {_leaf(old.get(p))} in the checkpoint, {_leaf(signature.get(p))} now"
        for p in list(old) + [p for p in signature if p not in old]
        if old.get(p) != signature.get(p)
    ]
    if state_diff or changed & set(MUST_MATCH_KEYS):
        raise CheckpointError(
            f"Checkpoint {where} does not match this run and was left untouched. "
            f"Config differences: {listing(config_diff) if config_diff else 'none'}. "
            f"State differences: {listing(state_diff) if state_diff else 'none'}. Resume with "
            "the checkpoint's config, or start afresh in another hydra.run.dir."
        )
    if config_diff:
        logger.warning("%s %s with a changed config: %s.", action, where, "; ".join(config_diff))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _json(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value)


def _leaf(entry: list | None) -> str:
    return "absent" if entry is None else f"{tuple(entry[0])} {entry[1]}"


def listing(items: list[str], limit: int = 3) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
