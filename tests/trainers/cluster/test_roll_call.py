"""`trainers.cluster.roll_call`: the roll call before JAX's join, between real local processes.

Each process is `tests.roll_call_worker` (no JAX: the roll call comes before it) on a free
port of 127.0.0.1. The same launch mistakes through the CLI, with JAX's join after the roll
call, are in tests/trainers/cluster/test_multihost_cli.py.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tests import REPO
from tests.multihost_cli import free_port
from trainers.cluster.roll_call import Answer, roll_call_mistake

#: Each worker's wait: the bound a mistake must beat by far, and that a missing process takes.
WAIT_S = 30.0


def start(address: str, pid: int, count: int, wait_s: float = WAIT_S) -> subprocess.Popen:
    """One worker answering the roll at `address` as process `pid` of `count`."""
    args = [address, str(pid), str(count), str(wait_s)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.roll_call_worker", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outcomes(procs: Sequence[subprocess.Popen]) -> list[tuple[int, str]]:
    """Every worker's (exit status, printed line), each waited for at most twice `WAIT_S`;
    its log (stderr) must hold no traceback."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=2 * WAIT_S)
        assert "Traceback" not in err, err
        results.append((proc.returncode, out.strip()))
    return results


def roll(*processes: tuple[int, int]) -> tuple[list[tuple[int, str]], float, str]:
    """Starts one worker per (process_id, num_processes) on a fresh port; returns their
    outcomes, the seconds until the last ended, and the address."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    results = outcomes([start(address, pid, count) for pid, count in processes])
    return results, time.monotonic() - started, address


def test_distinct_ids_and_one_count_pass_the_roll_call():
    results, _, _ = roll((1, 3), (0, 3), (2, 3))
    assert results == [(0, "ok")] * 3, results


def test_two_processes_0_on_one_host_are_both_refused_at_once():
    results, took, address = roll((0, 2), (0, 2))
    assert took < WAIT_S / 2, results  # neither waits for the timeout
    lines = {out for _, out in results}
    assert [code for code, _ in results] == [2, 2] and len(lines) == 1, results
    (line,) = lines
    assert line.startswith(
        f"error: distributed.process_id=0 was given to 2 processes of the run at "
        f"distributed.coordinator_address='{address}' ("
    ), line
    assert "0 <= process_id < distributed.num_processes=2." in line, line


def test_a_process_id_given_twice_refuses_every_process_at_once():
    # The run never completes (no process 2): only the duplicate ends the roll call early.
    results, took, _ = roll((0, 3), (1, 3), (1, 3))
    assert took < WAIT_S / 2, results
    assert [code for code, _ in results] == [2, 2, 2], results
    for _, out in results:
        assert "error: distributed.process_id=1 was given to 2 processes of the run" in out, out


def test_different_num_processes_refuse_every_process_with_each_value():
    results, took, _ = roll((1, 3), (0, 2))  # 1 first: it may answer before 0 itself
    assert took < WAIT_S / 2, results
    assert [code for code, _ in results] == [2, 2], results
    for _, out in results:
        assert out.startswith("error: distributed.num_processes differs between the processes")
        assert re.search(r": 2 on process 0 \([^)]*\); 3 on process 1 \([^)]*\)\. ", out), out
        assert "(process 0 has 2)" in out, out


def test_a_missing_process_0_is_waited_for_until_the_deadline_only():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    [(code, out)] = outcomes([start(address, 1, 2, wait_s=3.0)])
    assert (code, out) == (3, "timeout")
    assert 3.0 <= time.monotonic() - started < WAIT_S


def test_a_process_that_died_while_waiting_can_be_started_again():
    address = f"127.0.0.1:{free_port()}"
    lead = start(address, 0, 3)
    first = start(address, 1, 3, wait_s=3.0)  # answers, then gives up: its answer goes
    assert outcomes([first]) == [(3, "timeout")]
    again = [start(address, 1, 3), start(address, 2, 3)]
    assert outcomes([*again, lead]) == [(0, "ok")] * 3


def test_another_program_on_the_port_is_named_and_not_joined():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def greet() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=greet, daemon=True).start()
        [(code, out)] = outcomes([start(address, 1, 2)])
    assert code == 2, out
    assert out == (
        f"error: distributed.coordinator_address='{address}': what answered there is not "
        "xshard's process 0 calling the roll of its processes, but another program. Give every "
        "process of one run process 0's host:port, a port no other program uses."
    )


def test_one_process_answering_on_two_connections_is_not_a_duplicate():
    retried = [Answer(0, 2, "a:1"), Answer(1, 2, "b:2"), Answer(0, 2, "a:1")]
    assert roll_call_mistake(retried, 2, "h:1") is None


def test_process_0s_count_is_named_first():
    twice = [Answer(0, 2, "a:1"), Answer(1, 3, "b:2"), Answer(0, 2, "a:1")]  # 0's own, again
    line = roll_call_mistake(twice, 2, "h:1")
    assert line is not None and ": 2 on process 0 (a:1); 3 on process 1 (b:2). " in line, line
