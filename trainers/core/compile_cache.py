"""JAX's persistent compilation cache: programs compiled once are read back by later runs.

`enable_compilation_cache` points JAX at a dir (``trainer.compilation_cache_dir``, by default
the user's cache dir, ``$XDG_CACHE_HOME/xshard/jax`` or ``~/.cache/xshard/jax``) before the
run's first compilation, and caches every program, however small or quick to compile (JAX's
defaults skip those compiled in under a second, which is most CPU programs). Every job of a
sweep and every rerun with the same dir reads the programs compiled before: the key is the
program, the devices and the compile options, so a changed config compiles anew.

`CacheCounts` counts the hits and misses JAX reports (``jax.monitoring`` events), for the run
summary.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import NamedTuple

import jax

log = logging.getLogger(__name__)

#: The ``jax.monitoring`` events of a program read from the cache, and of one compiled anew.
HIT_EVENT = "/jax/compilation_cache/cache_hits"
MISS_EVENT = "/jax/compilation_cache/cache_misses"


def enable_compilation_cache(directory: Path | None) -> Path | None:
    """Points JAX's persistent compilation cache at `directory`, or turns it off.

    Call before the run's first compilation. A dir that cannot be created leaves the cache off
    with a warning: a run never fails for want of a cache.

    Args:
      directory: the cache dir (``trainer.compilation_cache_dir`` as the app resolved it:
        `trainers.rundir.user_paths`); None: no persistent cache.

    Returns:
      The dir in use, or None.
    """
    from jax.experimental.compilation_cache import compilation_cache

    _count_events()
    if directory is None:
        _set_dir(None, compilation_cache)
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning(
            "trainer.compilation_cache_dir=%s cannot be used (%s): compiling without a cache.",
            directory,
            e.strerror or e,
        )
        _set_dir(None, compilation_cache)
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _set_dir(str(directory), compilation_cache)
    return directory


def _set_dir(directory: str | None, compilation_cache) -> None:
    """Sets JAX's cache dir; a process that already used another one (the jobs of a sweep in
    one process) has its cache reset, so that the new dir takes effect."""
    if jax.config.jax_compilation_cache_dir != directory:  # type: ignore[attr-defined]
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", directory)


class CacheCounts(NamedTuple):
    """Programs read from the persistent cache (hits) and compiled anew (misses)."""

    hits: int = 0
    misses: int = 0

    def since(self, earlier: CacheCounts) -> CacheCounts:
        """The counts after `earlier` (a snapshot of `cache_counts`)."""
        return CacheCounts(self.hits - earlier.hits, self.misses - earlier.misses)


# JAX's event listeners are process-wide, so are their counts (read as differences: `since`).
_counts = {HIT_EVENT: 0, MISS_EVENT: 0}
_lock = threading.Lock()


def cache_counts() -> CacheCounts:
    """The hits and misses of this process so far (`enable_compilation_cache` starts
    counting)."""
    with _lock:
        return CacheCounts(_counts[HIT_EVENT], _counts[MISS_EVENT])


def _on_event(event: str, **kwargs: object) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


@functools.cache
def _count_events() -> None:
    """Registers the ``jax.monitoring`` listener, once per process (cached)."""
    jax.monitoring.register_event_listener(_on_event)
