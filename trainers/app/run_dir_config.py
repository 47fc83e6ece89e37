"""A finished run's saved config, read as untrusted input: what `trainers.evaluate` and
`trainers.load` build from.

A run dir may come from elsewhere (copied, downloaded), so its ``.hydra/config.yaml`` is a
config file like any other that is not the user's primary config (`trainers.app.config_guard`):
it may not set ``hydra`` keys that run code, nor widen ``allowed_targets`` beyond what the
user's own sources grant (the command line's ``+allowed_targets=[...]``,
``XSHARD_ALLOWED_TARGETS``, installed packages; `trainers.app.allowlist`). The file is read
with OmegaConf alone, no Hydra app acts on it, and every ``_target_`` of it is then built under
that allowlist by the same builders as training (`trainers.app.builders`). Its ``paths`` are the
run dir's own: ``<run dir>/checkpoints`` holds the checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainers.config.cli_args import override_assignment
from trainers.exits import UntrustedConfigError
from trainers.rundir.user_paths import user_path
from xshard.config.targets import ALLOWED_TARGETS_KEY
from xshard.errors import ConfigError

#: The saved config of a run, relative to its dir (Hydra's ``hydra.output_subdir``).
CONFIG_FILE = Path(".hydra") / "config.yaml"
#: The run's checkpoints, relative to its dir.
CHECKPOINTS = "checkpoints"


def checked_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` as an absolute path, if it is a run dir: a directory with a saved config and
    checkpoints. A relative `run_dir` is relative to the working directory now, ``~``
    expanded (`trainers.rundir.user_paths.user_path`).

    Raises:
      ConfigError: naming what is missing.
    """
    path = user_path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"run dir {str(run_dir)!r}: no such directory.")
    for needed in (CONFIG_FILE, Path(CHECKPOINTS)):
        if not (path / needed).exists():
            raise ConfigError(
                f"run dir {str(run_dir)!r} is not a run dir of trainers.train: it has no "
                f"{needed} (expected a run's hydra.run.dir, holding .hydra/ and checkpoints/)."
            )
    return path


def read_run_config(run_dir: Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The run's saved config, checked as an untrusted file, with `overrides` applied.

    Args:
      run_dir: a checked run dir (`checked_run_dir`).
      overrides: ``key=value`` overrides, as typed (``trainer.eval_batches=20``); an
        ``allowed_targets`` entry among them is the user's, and so trusted.

    Returns:
      The config, ``paths`` set to the run dir's.

    Raises:
      UntrustedConfigError: the file sets a key a copied file may not set (a ``hydra`` key
        that runs code, an ``allowed_targets`` entry nobody trusted granted).
      ConfigError: the file is not a YAML mapping, or an override is not ``key=value``.
    """
    from trainers.app.allowlist import command_line_entries, environment_entries, installed_entries
    from trainers.app.config_guard import check_file
    from trainers.app.trust import ComposedFile, is_location, leaves

    path = run_dir / CONFIG_FILE
    try:
        content = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # a broken file is bad input, one line
        raise ConfigError(f"{path}: not a readable YAML config ({type(e).__name__}).") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys.")
    granted = frozenset(command_line_entries(overrides) | environment_entries())
    granted |= installed_entries()
    _refuse_ungranted_entries(path, content.get(ALLOWED_TARGETS_KEY), granted)
    kept = {k: v for k, v in content.items() if k not in ("hydra", "paths")}
    for key, _ in list(leaves(kept)):  # where the run wrote is the run's own: not reused here
        if is_location(key):
            _drop(kept, key.split("."))
    hydra = {"hydra": content["hydra"]} if "hydra" in content else {}
    saved = ComposedFile(str(path), False, "", {**kept, **hydra})
    check_file(saved, granted)
    cfg = OmegaConf.create(kept)
    for override in overrides:
        assigned = override_assignment(override)
        if assigned is None:
            raise ConfigError(f"override {override!r}: expected key=value.")
        OmegaConf.update(cfg, *assigned, force_add=True)
    entries = list(cfg.get(ALLOWED_TARGETS_KEY) or [])
    cfg[ALLOWED_TARGETS_KEY] = entries + sorted(granted - set(entries))
    cfg.paths = {
        "output_dir": str(run_dir),
        "tb_dir": str(run_dir / "tb"),
        "checkpoint_dir": str(run_dir / CHECKPOINTS),
    }
    return cfg


def _refuse_ungranted_entries(path: Path, node: Any, granted: frozenset[str]) -> None:
    """Refuses the saved ``allowed_targets`` entries no source of this process grants, saying
    how to trust one's own package: its entry point, the command line or the environment.

    The saved config records the entries the run had; only this process's sources can make
    them count (a copied run dir must not widen the allowlist).

    Raises:
      UntrustedConfigError: naming the entries and the three ways to grant them.
    """
    from trainers.app.allowlist import ALLOWED_TARGETS_ENV, entry_point_lines, file_entries

    if node is None:
        return
    entries = file_entries(node)
    ungranted = [e for e in entries if e is not None and e not in granted]
    if not ungranted or None in entries:  # an entry read elsewhere: `check_file` names it
        return
    listed = ",".join(ungranted)
    raise UntrustedConfigError(
        f"{path} allows _target_s under {listed!r} ({ALLOWED_TARGETS_KEY}), which nothing this "
        "process trusts grants: a run dir's saved config cannot widen the allowlist by itself "
        "(a copied one could name any code). If it is your own package, declare it in its "
        f"pyproject.toml and reinstall it ('pip install -e .'): {entry_point_lines(ungranted)}; "
        f"or pass '+{ALLOWED_TARGETS_KEY}=[{listed}]', or export "
        f"{ALLOWED_TARGETS_ENV}={listed} (docs/reliability.md, Threat model)."
    )


def _drop(node: dict[Any, Any], path: list[str]) -> None:
    """Removes the key at `path` from the nested mapping `node` (the schema's default then
    applies)."""
    parent: Any = node
    for part in path[:-1]:
        parent = parent.get(part) if isinstance(parent, dict) else None
    if isinstance(parent, dict):
        parent.pop(path[-1], None)
