"""TensorBoard events, thread and queue or the calling thread: ``python -m benchmarks.tb_events``.

Logs N=1000 steps of 30 scalars, one event per step, two ways in one process:

* ``summary_writer``: tensorboardX's `SummaryWriter` (what the trainer used until issue 33):
  the event goes on a queue; a thread serializes and writes it, and flushes every 10 s;
* ``events_writer``: `trainers.hooks.tensorboard.TensorBoardSink` (tensorboardX's
  `EventsWriter` in the calling thread, a flush every ``logger.flush_secs`` = 10 s).

Prints, per step, the time in the logging loop and the time including the final close (what
the writer thread still had to do), best and median of 5 alternating rounds, and whether
tensorboardX checksums natively (the ``crc32c`` package) or in pure Python.
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable

from tensorboardX import SummaryWriter
from tensorboardX.proto.summary_pb2 import Summary

from trainers.hooks.log_sink import RunInfo
from trainers.hooks.tensorboard import TensorBoardSink

STEPS, ROUNDS = 1000, 5
TAGS = [f"group{i % 6}/scalar_{i}" for i in range(30)]


def summary_writer(logdir: str) -> tuple[float, float]:
    """(seconds in the loop, seconds including close) with a `SummaryWriter`."""
    writer = SummaryWriter(logdir, flush_secs=10, max_queue=1 << 20)
    start = time.perf_counter()
    for step in range(STEPS):
        values = [Summary.Value(tag=tag, simple_value=step * 0.5) for tag in TAGS]
        writer.file_writer.add_summary(Summary(value=values), step)
    looped = time.perf_counter() - start
    writer.close()
    return looped, time.perf_counter() - start


def events_writer(logdir: str) -> tuple[float, float]:
    """(seconds in the loop, seconds including close) with a `TensorBoardSink`."""
    sink = TensorBoardSink(logdir, flush_secs=10)
    sink.start(RunInfo())
    start = time.perf_counter()
    for step in range(STEPS):
        sink.log_scalars(step, {tag: step * 0.5 for tag in TAGS})
    looped = time.perf_counter() - start
    sink.finish({}, True)
    return looped, time.perf_counter() - start


def main() -> None:
    """Runs both writers `ROUNDS` times, alternating, and prints microseconds per step."""
    ways: dict[str, Callable[[str], tuple[float, float]]] = {
        "summary_writer": summary_writer,
        "events_writer": events_writer,
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, way in ways.items():
            with tempfile.TemporaryDirectory() as logdir:
                times[name].append(way(logdir))
    native = importlib.util.find_spec("crc32c") is not None  # tensorboardX uses it if there
    print(f"{STEPS} steps of {len(TAGS)} scalars; native crc32c: {native}")
    for name, runs in times.items():
        loop = [r[0] / STEPS * 1e6 for r in runs]
        total = [r[1] / STEPS * 1e6 for r in runs]
        mid_loop, mid_total = statistics.median(loop), statistics.median(total)
        print(
            f"{name:>15}: {min(loop):6.0f} us/step in the loop (median {mid_loop:.0f}),"
            f" {min(total):6.0f} us/step with close (median {mid_total:.0f})"
        )


if __name__ == "__main__":
    main()
