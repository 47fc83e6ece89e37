"""``trainer.grad_impl=auto``'s choices, remembered: a run that lowers the same plain programs
on the same kind of machine as an earlier run keeps the path that run's race chose, and
neither compiles nor times the other path again.

The choices live beside the programs, in JAX's persistent compilation cache
(``trainer.compilation_cache_dir``): one JSON file per `trainers.core.path_race.race_key` under
``grad_impl_race/``, holding the race's record (`trainers.core.path_race.RaceResult` as a dict)
and when it ran. So every rerun of a config and every job of a sweep over hyperparameters
(inputs of the programs: the same programs) runs the path the first one chose, bitwise as
that path runs, where races of their own could keep different paths when the two are within
noise. With no cache dir (``trainer.compilation_cache_dir=null``) every run races.

A file that cannot be read, or that names no path the run can take, is left aside with a
warning and the run races (and writes it again); one that cannot be written costs a warning,
never the run. Delete a file (or the dir) to race again, e.g. on a machine whose load changed.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from trainers.rundir.links import write_file

log = logging.getLogger("trainers.train")

#: The dir under the compilation cache dir that holds the remembered races.
MEMORY_DIR = "grad_impl_race"
#: The record's keys a remembered race adds to the race's own (`RaceResult`'s fields).
RACED_AT, REMEMBERED = "raced_at", "remembered"


def memory_file(cache_dir: Path, key: str) -> Path:
    """Where the race of `key` (`trainers.core.path_race.race_key`) is remembered."""
    return cache_dir / MEMORY_DIR / f"{key}.json"


def recall(cache_dir: Path, key: str, paths: Collection[str]) -> dict[str, Any] | None:
    """The remembered race of `key` (its record, with the file it was read from under
    `REMEMBERED`), or None: none remembered, or one that cannot be used (a warning says why)."""
    file = memory_file(cache_dir, key)
    try:
        record = json.loads(file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("trainer.grad_impl=auto: racing again: %s cannot be read (%s).", file, e)
        return None
    ms = record.get("ms_per_step") if isinstance(record, dict) else None
    if (
        not isinstance(ms, dict)
        or record.get("chosen") not in paths
        or not all(name in paths and isinstance(v, (int, float)) for name, v in ms.items())
    ):
        log.warning(
            "trainer.grad_impl=auto: racing again: %s does not hold a race between %s.",
            file,
            " and ".join(paths),
        )
        return None
    return {**record, REMEMBERED: str(file)}


def remember(cache_dir: Path, key: str, race: Mapping[str, Any]) -> None:
    """Writes the record of the race of `key` (`RaceResult` as a dict) with the time it ran,
    atomically (concurrent jobs of a sweep each through a file of their own); a failure (a
    read-only or full disk) is a warning."""
    file = memory_file(cache_dir, key)
    now = datetime.datetime.now(datetime.UTC).isoformat("T", "seconds")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_file(
            file, json.dumps({**race, RACED_AT: now}, indent=1), tmp_name=f"{key}.{os.getpid()}.tmp"
        )
    except OSError as e:
        log.warning(
            "trainer.grad_impl=auto: the race's choice is not remembered (%s: %s).", file, e
        )
