"""Hydra SearchPathPlugin: makes xshard's config groups composable from any repository.

Hydra imports every module under the ``hydra_plugins`` namespace package when it starts, so
once xshard is installed, a user's own primary config can select ``optimizer: adamw`` or
``reduction: sum`` with no ``hydra.searchpath`` entry. The import also registers xshard's
structured-config schemas, which the YAML options extend. This module must stay cheap: it
imports Hydra and the schema dataclasses only, never JAX or the ``xshard`` package.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from hydra_plugins.xshard_searchpath import _schemas

XSHARD_CONFIG_PATH = "pkg://xshard.conf"

_schemas.register_schemas()


class XShardSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://xshard.conf`` so its groups sit behind the user's own configs."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="xshard", path=XSHARD_CONFIG_PATH)
