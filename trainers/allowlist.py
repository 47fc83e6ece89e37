"""Who may widen the ``_target_`` allowlist: the primary config file or the command line.

`xshard.targets` decides what a ``_target_`` may resolve to, given the allowed entries; the
config key ``allowed_targets`` adds entries. Experiment files, sweep files and other composed
configs are copied between repos, so an entry that reaches the composed config from one of
them (``allowed_targets: [os.]`` in ``experiment/evil.yaml``) is refused. In the Hydra app, an
entry counts only if it is listed in:

- the primary config file itself (``--config-name``, default ``xshard_train``), read alone from
  the run's config search path, without its defaults list; or
- a command-line override of ``allowed_targets`` (``+allowed_targets=[mypkg.]``), as parsed by
  Hydra's own override parser from ``hydra.overrides.task``.

Interpolations in those two places are resolved on their own (``${oc.env:...}`` works; a
reference to a key that another file sets does not count). A plain Python caller of
``trainers.train.train(cfg)`` is trusted: this check runs in the Hydra app only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xshard.config_nodes import section
from xshard.errors import ConfigError
from xshard.targets import ALLOWED_TARGETS_KEY, allowed_prefixes

log = logging.getLogger("trainers.allowlist")


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


def command_line_entries(overrides: Iterable[str]) -> set[str]:
    """The ``allowed_targets`` entries set by command-line overrides.

    Args:
      overrides: the run's task overrides (``HydraConfig.get().overrides.task``).

    Returns:
      Every string value given to ``allowed_targets`` or one of its elements.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found: set[str] = set()
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_delete() or override.package is not None:
            continue
        if key == ALLOWED_TARGETS_KEY or key.startswith(ALLOWED_TARGETS_KEY + "."):
            value = override.value()
            if isinstance(value, str | list):
                found |= _strings(value)
    return found


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
    if loaded is None or not OmegaConf.is_dict(loaded.config):
        return set()
    try:  # interpolations resolve within the primary file alone
        node = loaded.config.get(ALLOWED_TARGETS_KEY)
    except OmegaConfBaseException:  # it refers to a key that another file sets
        return set()
    return set() if node is None else _strings(node)


def check_allowlist_sources(cfg: DictConfig) -> None:
    """Refuses ``allowed_targets`` entries that come from neither the primary config nor the CLI.

    Call it from the Hydra task function only (it reads the running job's `HydraConfig`).

    Args:
      cfg: the composed config of the job.

    Raises:
      ConfigError: naming the first entry that another (composed) config file added.
    """
    from hydra.core.hydra_config import HydraConfig

    composed = section(cfg, ALLOWED_TARGETS_KEY, required=False)
    allowed_prefixes(composed)  # raises ConfigError unless a list of dotted names
    if not composed:
        return
    hydra_cfg = HydraConfig.get()
    config_name = hydra_cfg.job.config_name
    trusted = command_line_entries(hydra_cfg.overrides.task) | primary_config_entries(
        config_name, hydra_cfg.runtime.config_sources
    )
    for entry in composed:
        if entry not in trusted:
            raise ConfigError(
                f"{ALLOWED_TARGETS_KEY}: {entry!r} was added by a composed config file, not "
                f"by the primary config ({config_name!r}) or the command line; only the primary "
                "config or the command line may widen the allowlist. If you trust it, add it "
                f"to '{ALLOWED_TARGETS_KEY}' in your primary config or pass "
                f"'+{ALLOWED_TARGETS_KEY}=[{entry}]' on the command line."
            )


def log_active_prefixes(cfg: DictConfig) -> tuple[str, ...]:
    """Logs (INFO) and returns the allowed ``_target_`` entries of this run.

    Raises:
      ConfigError: if ``allowed_targets`` is not a list of dotted names.
    """
    active = allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))
    log.info("Allowed _target_ prefixes: %s", list(active))
    return active
