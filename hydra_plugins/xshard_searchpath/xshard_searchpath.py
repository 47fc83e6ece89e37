"""Hydra SearchPathPlugin: makes xshard's config groups composable from any repository.

Hydra imports every module under the ``hydra_plugins`` namespace package when it starts, so
once xshard is installed, a user's own primary config can select ``optimizer: adamw`` or
``reduction: sum`` with no ``hydra.searchpath`` entry. The import also registers xshard's
structured-config schemas (`xshard.config.schemas`, `trainers.config.trainer_schemas`), which
the YAML options extend, and the resolvers its configs use (`trainers.config.resolvers`, and
``${xshard.help:}`` of ``hydra.help.template``, `trainers.app.help`): any Hydra app whose
config composes ``xshard_train`` answers ``--help``. It stays cheap: neither this module nor
`xshard.config`, `trainers.config` or `trainers.app.help` imports JAX.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from trainers.app.help import register_help_resolver
from trainers.config.resolvers import register_resolvers
from trainers.config.trainer_schemas import register_trainer_schemas
from xshard.config.schemas import register_schemas

XSHARD_CONFIG_PATH = "pkg://xshard.conf"

register_schemas()
register_trainer_schemas()
register_resolvers()
register_help_resolver()


class XShardSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://xshard.conf`` so its groups sit behind the user's own configs."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="xshard", path=XSHARD_CONFIG_PATH)
