"""Counting tracing, lowering and XLA compilations with `jax.monitoring`.

JAX records a duration event for every jaxpr trace, every lowering to an MLIR module and every
backend (XLA) compilation it performs. A listener registered around a block of code therefore
sees exactly the compilations that block caused, whichever API triggered them (``jax.jit``
calls, ``.lower().compile()``, ``pmap``), which makes "no step after the first compiles" a
checkable fact instead of an assumption.
"""

from __future__ import annotations

import dataclasses
import time
from types import TracebackType
from typing import Self

import jax

#: Event names of jax/_src/dispatch.py (stable since jax 0.4.x).
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileEvents:
    """Context manager recording the compile events and the wall time of its block.

    Attributes:
      traces / lowerings / compiles: number of events of each kind.
      trace_s / lower_s / compile_s: their summed durations in seconds.
      wall_s: wall time of the block.
    """

    traces: int = 0
    lowerings: int = 0
    compiles: int = 0
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0
    wall_s: float = 0.0

    def _listen(self, event: str, duration: float, **_: object) -> None:
        if event == TRACE_EVENT:
            self.traces += 1
            self.trace_s += duration
        elif event == LOWER_EVENT:
            self.lowerings += 1
            self.lower_s += duration
        elif event == COMPILE_EVENT:
            self.compiles += 1
            self.compile_s += duration

    def __enter__(self) -> Self:
        self._listener = self._listen  # one bound method, to unregister the same object
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.wall_s += time.perf_counter() - self._start
        jax.monitoring.unregister_event_duration_listener(self._listener)

    def as_dict(self) -> dict[str, float | int]:
        """The counts and durations, rounded for the report."""
        return {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()
        }
