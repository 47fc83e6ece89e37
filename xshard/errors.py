"""Errors raised for bad configuration."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, of the wrong kind or not allowed.

    The message names the config key (e.g. ``reduction.mode``), the bad value and what is
    allowed, so that it can be fixed from the CLI without reading the code.
    """
