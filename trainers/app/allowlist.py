"""Who may widen the ``_target_`` allowlist: sources no copied config file can write.

`xshard.config.targets` decides what a ``_target_`` may resolve to, given the allowed entries; the
config key ``allowed_targets`` adds entries. Config files are copied between repos, so an entry
that reaches the composed config from one of them (``allowed_targets: [os.]`` in
``experiment/evil.yaml``) is refused. In the Hydra app, an entry counts only if it comes from:

- the primary config file itself (``--config-name``, default ``xshard_train``), read alone from
  the run's config search path, without its defaults list;
- the process's own command line (``+allowed_targets=[mypkg.]``, which adds to the primary
  config's entries), as parsed by Hydra's own argument and override parsers from
  ``sys.argv``. Not from ``hydra.overrides.task``: Hydra
  appends the real overrides to whatever a composed file wrote there;
- the environment variable ``XSHARD_ALLOWED_TARGETS`` (comma-separated entries) as the
  process was started with, which `trainers.main` also uses to hand the command line's entries
  to a launcher's processes; a job whose ``hydra.job.env_set`` sets it is refused (Hydra
  exports env_set before the task function runs, and a sweep's overrides can set it);
- installed packages, through the entry point group ``xshard.allowed_targets`` (each entry
  point's value is a module, whose whole package is then allowed): code a user installs is
  trusted.

`trainers.app.config_guard` refuses, before Hydra uses the config, any other file that sets
``allowed_targets`` or ``hydra.overrides``; this module is the check at the job's start, which
also covers apps built on plain ``@hydra.main``. Interpolations in the primary config are
resolved on their own (``${oc.env:...}`` works; a reference to a key that another file sets
does not count). A plain Python caller of ``trainers.train.train(cfg)`` is trusted: this
check runs in the Hydra app only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainers.config.cli_args import argv_overrides
from xshard.config.sections import section
from xshard.config.targets import ALLOWED_TARGETS_KEY, allowed_prefixes
from xshard.errors import ConfigError

log = logging.getLogger("trainers.app.allowlist")


def _strings(node: Any) -> set[str]:
    """The string entries of a list node (or one string), each resolved where it stands.

    An entry whose interpolation cannot be resolved there (it refers to a key that some other
    file sets) is left out.
    """
    if not isinstance(node, ListConfig):
        node = OmegaConf.create({"v": node if isinstance(node, list) else [node]}).v
    items = (_resolved(node, i) for i in range(len(node)))
    return {item for item in items if isinstance(item, str)}


def _resolved(node: ListConfig, index: int) -> Any:
    """``node[index]`` with interpolations resolved; None if they cannot be resolved there."""
    try:
        return node[index]
    except OmegaConfBaseException:
        return None


def file_entries(node: Any) -> list[str | None]:
    """The entries of an ``allowed_targets`` value as one file wrote it, resolved there alone.

    Args:
      node: the value (a list, a ``{index: entry}`` mapping, or one string), as written.

    Returns:
      Each entry resolved within that value alone (``${oc.env:...}`` works); None for an entry
      that is not a string or refers to a key set elsewhere.
    """
    if isinstance(node, dict | DictConfig):
        node = list(node.values())
    items = OmegaConf.create({"v": node if isinstance(node, list | ListConfig) else [node]}).v
    return [
        item if isinstance(item := _resolved(items, i), str) else None for i in range(len(items))
    ]


def command_line_entries(overrides: Iterable[str]) -> set[str]:
    """The ``allowed_targets`` entries set by command-line overrides.

    Args:
      overrides: override strings as typed (`argv_overrides`); ones that do not parse as
        overrides are skipped.

    Returns:
      Every string value given to ``allowed_targets`` or one of its elements.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found: set[str] = set()
    for line in overrides:
        try:
            override = parser.parse_override(line)
        except HydraException:
            continue
        key = override.key_or_group
        if override.is_delete() or override.package is not None:
            continue
        if key == ALLOWED_TARGETS_KEY or key.startswith(ALLOWED_TARGETS_KEY + "."):
            value = override.value()
            if isinstance(value, str | list):
                found |= _strings(value)
    return found


#: The environment variable whose comma-separated entries widen the allowlist.
ALLOWED_TARGETS_ENV = "XSHARD_ALLOWED_TARGETS"
#: The entry point group through which installed packages widen the allowlist.
ENTRY_POINT_GROUP = "xshard.allowed_targets"


def environment_entries() -> set[str]:
    """The entries of ``XSHARD_ALLOWED_TARGETS`` (comma-separated; blanks ignored)."""
    raw = os.environ.get(ALLOWED_TARGETS_ENV, "")
    return {entry.strip() for entry in raw.split(",") if entry.strip()}


def installed_entries() -> set[str]:
    """The packages that installed distributions declare in ``xshard.allowed_targets``.

    An entry point ``my_models = "my_models"`` allows ``my_models.`` (the whole package).
    """
    from importlib.metadata import entry_points

    found = set()
    for point in entry_points(group=ENTRY_POINT_GROUP):
        module = point.value.split(":", 1)[0].strip()
        if module:
            found.add(module.rstrip(".") + ".")
    return found


def entry_point_lines(entries: Iterable[str]) -> str:
    """The ``pyproject.toml`` lines that make an installed package grant `entries`
    (`installed_entries`), on one line: ``[project.entry-points."xshard.allowed_targets"]
    my_experiments = "my_experiments"``."""
    modules = sorted({entry.rstrip(".") for entry in entries})
    points = " ".join(f'{module} = "{module}"' for module in modules)
    return f'[project.entry-points."{ENTRY_POINT_GROUP}"] {points}'


def export_command_line_entries() -> None:
    """Adds the command line's ``allowed_targets`` entries to ``XSHARD_ALLOWED_TARGETS``.

    Processes that a Hydra launcher starts (submitit) run with another command line but the
    same environment, so the entries the user typed still count there.
    """
    typed = command_line_entries(argv_overrides())
    if typed:
        os.environ[ALLOWED_TARGETS_ENV] = ",".join(sorted(environment_entries() | typed))


def primary_config_entries(config_name: str | None, config_sources: Iterable[Any]) -> set[str]:
    """The ``allowed_targets`` entries written in the primary config file itself.

    Args:
      config_name: the primary config's name (``HydraConfig.get().job.config_name``).
      config_sources: the run's config search path (``HydraConfig.get().runtime.
        config_sources``: items with ``provider``, ``schema`` and ``path``).

    Returns:
      The entries of that file's own ``allowed_targets`` (its defaults list is not composed).
    """
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.plugins import Plugins

    if not config_name:
        return set()
    Plugins.instance()  # registers the config source types (file://, pkg://, structured://)
    search_path = ConfigSearchPathImpl()
    for source in config_sources:
        search_path.append(provider=source.provider, path=f"{source.schema}://{source.path}")
    loaded = ConfigRepository(search_path).load_config(config_name)
    if loaded is None or not isinstance(loaded.config, DictConfig):  # OmegaConf.is_dict
        return set()
    try:  # interpolations resolve within the primary file alone
        node = loaded.config.get(ALLOWED_TARGETS_KEY)
    except OmegaConfBaseException:  # it refers to a key that another file sets
        return set()
    return set() if node is None else _strings(node)


def check_allowlist_sources(cfg: DictConfig) -> None:
    """Refuses ``allowed_targets`` entries that come from no trusted source (module docstring).

    Call it from the Hydra task function only (it reads the running job's `HydraConfig`).

    Args:
      cfg: the composed config of the job.

    Raises:
      ConfigError: naming the first entry that another (composed) config file added.
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    if ALLOWED_TARGETS_ENV in (hydra_cfg.job.env_set or {}):
        raise ConfigError(
            f"hydra.job.env_set.{ALLOWED_TARGETS_ENV}: the allowlist is widened by the "
            "environment the run is started in, never by Hydra's env_set (a config or a sweep "
            f"can set that); export {ALLOWED_TARGETS_ENV} before the command, or pass "
            f"+{ALLOWED_TARGETS_KEY}=[...] on the command line."
        )
    composed = section(cfg, ALLOWED_TARGETS_KEY, required=False)
    allowed_prefixes(composed)  # raises ConfigError unless a list of dotted names
    if not composed:
        return
    config_name = hydra_cfg.job.config_name
    trusted = (
        command_line_entries(argv_overrides())
        | primary_config_entries(config_name, hydra_cfg.runtime.config_sources)
        | environment_entries()
        | installed_entries()
    )
    for entry in composed:
        if entry not in trusted:
            raise ConfigError(
                f"{ALLOWED_TARGETS_KEY}: {entry!r} was added by a composed config file, not "
                f"by the primary config ({config_name!r}), the command line, "
                f"{ALLOWED_TARGETS_ENV} or an installed package; a copied config file may not "
                f"widen the allowlist. If you trust it, add it to '{ALLOWED_TARGETS_KEY}' in "
                f"your primary config or pass '+{ALLOWED_TARGETS_KEY}=[{entry}]' on the "
                "command line."
            )


def add_trusted_entries(cfg: DictConfig) -> None:
    """Adds the entries of the primary config, ``XSHARD_ALLOWED_TARGETS`` and installed
    packages to `cfg`.

    After this, ``cfg.allowed_targets`` is the run's whole list of extra entries, which every
    builder reads (`xshard.optim.factory`, `trainers.app.builders`). The command line adds to the
    primary config's list: ``+allowed_targets=[other.]`` (what the allowlist error suggests)
    keeps the primary config's entries, although Hydra's override replaced them.
    """
    from omegaconf import open_dict

    extra = environment_entries() | installed_entries() | _primary_entries()
    if not extra:
        return
    listed = section(cfg, ALLOWED_TARGETS_KEY, required=False) or []
    with open_dict(cfg):
        cfg[ALLOWED_TARGETS_KEY] = list(listed) + sorted(extra - set(listed))


def _primary_entries() -> set[str]:
    """The running job's primary config entries (`primary_config_entries`); none outside a
    Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    hydra_cfg = HydraConfig.get()
    return primary_config_entries(hydra_cfg.job.config_name, hydra_cfg.runtime.config_sources)


def log_active_prefixes(cfg: DictConfig) -> tuple[str, ...]:
    """Logs (INFO) and returns the allowed ``_target_`` entries of this run.

    Raises:
      ConfigError: if ``allowed_targets`` is not a list of dotted names.
    """
    active = allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))
    log.info("Allowed _target_ prefixes: %s", list(active))
    return active
