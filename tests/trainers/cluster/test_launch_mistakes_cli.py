"""Processes that must not form one run (different configs, a wrong coordinator address, a
process id given twice, different process counts): each process exits 2 with one line naming
the key, in bounded time, with no traceback or C++ abort (real local processes over gloo)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.multihost_cli import (
    PACED,
    PROCESSES,
    SMALL,
    distributed,
    finish,
    free_port,
    start,
    start_run,
    tail,
)
from tests.reliability_helpers import wait_until
from trainers.checkpoint.io import complete_steps

pytestmark = pytest.mark.multiprocess

# ------------------------------------------------------------------ refused at start-up


def start_two(tmp_path: Path, *per_process: list[str], common: tuple[str, ...] = ()) -> list:
    """Starts two processes of a short run, each with its own extra overrides; returns
    (procs, logs). The coordinator's port is the same for both unless an override sets it."""
    port = free_port()
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    args = [
        [
            *SMALL,
            "trainer.steps=4",
            "checkpoint.every_steps=2",
            *common,
            *distributed(port, pid),
            f"hydra.run.dir={tmp_path / 'run'}",
            *extra,
        ]
        for pid, extra in enumerate(per_process)
    ]
    return start(logs, args), logs


def error_lines(log: Path) -> list[str]:
    """The ``xshard: error:`` lines of a log; fails if it holds a traceback or an abort."""
    text = log.read_text()
    assert "Traceback" not in text and "stack trace" not in text, tail(log)
    assert "enforce fail" not in text and "Terminating process" not in text, tail(log)
    return [ln for ln in text.splitlines() if ln.startswith("xshard: error:")]


@pytest.mark.slow
def test_processes_with_different_learning_rates_refuse_to_start(tmp_path):
    procs, logs = start_two(
        tmp_path, ["optimizer.learning_rate=0.001"], ["optimizer.learning_rate=0.003"]
    )
    assert finish(procs, logs, timeout=180) == [2, 2], tail(logs[0]) + tail(logs[1])
    for log in logs:
        (line,) = error_lines(log)
        assert "given different configs: optimizer.learning_rate " in line, line
        assert "(0.001 on process 0, 0.003 on process 1)" in line, line
        assert "trainer.steps" not in line and "process_id" not in line.split(". Every")[0]
    assert not (tmp_path / "run" / "checkpoints").exists() or not complete_steps(
        tmp_path / "run" / "checkpoints"
    )


@pytest.mark.slow
def test_processes_with_different_steps_refuse_to_start_without_traceback_or_abort(tmp_path):
    started = time.monotonic()
    procs, logs = start_two(tmp_path, ["trainer.steps=4"], ["trainer.steps=6"])
    assert finish(procs, logs, timeout=180) == [2, 2], tail(logs[0]) + tail(logs[1])
    assert time.monotonic() - started < 150  # start-up (under load), then at once
    for log in logs:
        (line,) = error_lines(log)
        assert "trainer.steps (4 on process 0, 6 on process 1)" in line, line
        assert "Run completed" not in log.read_text()


@pytest.mark.slow
def test_a_wrong_coordinator_address_is_one_line_naming_the_key_in_bounded_time(tmp_path):
    wrong = f"127.0.0.1:{free_port()}"  # nothing listens there
    common = ("distributed.initialization_timeout_s=5",)
    started = time.monotonic()
    procs, logs = start_two(
        tmp_path, [], [f"distributed.coordinator_address={wrong}"], common=common
    )
    # JAX alone would abort both (SIGABRT, a C++ stack trace) after its own timeout.
    assert finish(procs, logs, timeout=180) == [2, 2], tail(logs[0]) + tail(logs[1])
    assert time.monotonic() - started < 120  # start-up (under load), then 5 s (+5 s on 0)
    (mine,) = error_lines(logs[1])
    assert f"distributed.coordinator_address='{wrong}': nothing answered there" in mine, mine
    assert "within distributed.initialization_timeout_s=5 s" in mine, mine
    (lead,) = error_lines(logs[0])
    assert "distributed.coordinator_address='127.0.0.1:" in lead, lead
    assert "the cluster did not form within distributed.initialization_timeout_s=5 s" in lead
    assert "not all distributed.num_processes=2 processes joined" in lead, lead


#: The join's timeout in the launch-mistake tests: long, so that a process that waited for it
#: (JAX alone: the whole timeout, or a C++ abort) fails the test's bound of a quarter of it.
LONG_JOIN_S = 600
LONG_JOIN = (f"distributed.initialization_timeout_s={LONG_JOIN_S}",)


@pytest.mark.slow
def test_two_processes_given_the_same_process_id_both_exit_2_at_once(tmp_path):
    started = time.monotonic()
    same = ["distributed.process_id=0"]
    procs, logs = start_two(tmp_path, same, same, common=LONG_JOIN)
    # JAX alone: both take the port (gRPC shares it) and wait for the whole timeout.
    assert finish(procs, logs, timeout=LONG_JOIN_S / 3) == [2, 2], tail(logs[0]) + tail(logs[1])
    assert time.monotonic() - started < LONG_JOIN_S / 4  # start-up (under load), then at once
    for log in logs:
        (line,) = error_lines(log)
        assert line.startswith(
            "xshard: error: distributed.process_id=0 was given to 2 processes of the run at "
            "distributed.coordinator_address='127.0.0.1:"
        ), line
        assert line.endswith(
            "Give each process its own distributed.process_id, "
            "0 <= process_id < distributed.num_processes=2."
        ), line


@pytest.mark.slow
def test_processes_given_different_num_processes_both_exit_2_at_once(tmp_path):
    started = time.monotonic()
    procs, logs = start_two(tmp_path, [], ["distributed.num_processes=3"], common=LONG_JOIN)
    # JAX alone: the cluster forms, a misleading line, then a C++ abort (exit 134).
    assert finish(procs, logs, timeout=LONG_JOIN_S / 3) == [2, 2], tail(logs[0]) + tail(logs[1])
    assert time.monotonic() - started < LONG_JOIN_S / 4
    for log in logs:
        (line,) = error_lines(log)
        assert "error: distributed.num_processes differs between the processes of the run" in line
        assert re.search(r": 2 on process 0 \([^)]*\); 3 on process 1 \([^)]*\)\. ", line), line
        assert "Give every process the same distributed.num_processes (process 0 has 2)" in line


@pytest.mark.slow
def test_a_process_whose_id_is_taken_is_kept_out_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    procs = start_run(run_dir, "trainer.steps=40", *LONG_JOIN, *PACED, logs=logs)
    try:
        wait_until(
            lambda: "Process 1 of 2" in logs[1].read_text() or procs[1].poll() is not None,
            180,
            "the cluster to form",
        )
        port = re.findall(r"127\.0\.0\.1:(\d+)", logs[0].read_text())[0]
        stray = [*SMALL, "trainer.steps=40", *LONG_JOIN, *PACED, *distributed(int(port), 1)]
        stray_log = tmp_path / "stray.log"
        started = time.monotonic()
        extra = start([stray_log], [[*stray, f"hydra.run.dir={tmp_path / 'stray'}"]])
        # JAX alone: the coordination service sees task 1 connect twice and aborts them all.
        assert finish(extra, [stray_log], timeout=LONG_JOIN_S / 3) == [2], tail(stray_log)
        assert time.monotonic() - started < LONG_JOIN_S / 4
        (line,) = error_lines(stray_log)
        assert line == (
            "xshard: error: distributed.process_id=1: the run at distributed.coordinator_address="
            f"'127.0.0.1:{port}' formed already (JAX's coordinator answered there): every one "
            "of its processes had answered the roll, so this process is one too many, and was "
            "kept out so as not to disturb it. Give each process its own distributed.process_id, "
            "0 <= process_id < distributed.num_processes=2, and start num_processes of them."
        )
        assert finish(procs, logs) == [0, 0], tail(logs[0]) + tail(logs[1])
        assert all(error_lines(log) == [] for log in logs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
