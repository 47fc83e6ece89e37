"""The benchmark's sections, in report order: name -> ``run(bench) -> dict``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.context import Bench
from benchmarks.sections import (
    collectives,
    compile_time,
    host,
    memory,
    optimizers,
    overhead,
    scaling,
    stats,
)

SECTIONS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "overhead": overhead.run,
    "stats": stats.run,
    "collectives": collectives.run,
    "memory": memory.run,
    "compile": compile_time.run,
    "host": host.run,
    "scaling": scaling.run,
    "optimizers": optimizers.run,
}
