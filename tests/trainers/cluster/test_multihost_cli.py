"""Multi-process runs a cluster can trust, end to end: two local processes x 4 CPU devices
over gloo (tests/multihost_cli.py), the real CLI, Orbax and TensorBoard (all marked slow).

One 2-process baseline run (checkpoints at 4, 8, 12) is the reference for the checkpoint
tests: a restore onto 1 process x 8 devices and back, and a run stopped by SIGTERM to one
process and resumed, which must end bitwise equal to it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.cli import run_train, scalars
from tests.multihost_cli import (
    PACED,
    PROCESSES,
    SMALL,
    distributed,
    finish,
    free_port,
    load_arrays,
    run,
    start,
    start_run,
    tail,
)
from tests.reliability_helpers import assert_bitwise_equal, wait_until
from trainers.checkpoint.io import complete_steps
from trainers.exits import EXIT_PEER_LOST, EXIT_PREEMPTED

pytestmark = [pytest.mark.long, pytest.mark.multiprocess]

STEPS = ["trainer.steps=12", "checkpoint.every_steps=4", "checkpoint.keep=null"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run of 12 steps in one run dir: checkpoints 4, 8, 12."""
    tmp = tmp_path_factory.mktemp("baseline")
    run(tmp / "run", *STEPS, tmp=tmp, name="baseline")
    assert complete_steps(tmp / "run" / "checkpoints") == [4, 8, 12]
    return tmp / "run"


def logged_step(log: Path) -> int:
    """The step of the "Stopped by ... at step N" line of a log."""
    found = re.search(r"preempted: Stopped by .* at step (\d+) of", log.read_text())
    assert found, tail(log)
    return int(found.group(1))


@pytest.mark.slow
def test_one_run_dir_only_process_0_writes_logs_events_and_config(baseline):
    assert (baseline / "tb").is_dir() and (baseline / "train.process-1.log").is_file()
    log0 = (baseline / "train.log").read_text()
    assert "Process 0 of 2" in log0 and "Process 1 of 2" not in log0
    assert "Process 1 of 2" in (baseline / "train.process-1.log").read_text()
    # Hydra wrote .hydra/ in both processes; process 0 wrote its own again afterwards.
    overrides = (baseline / ".hydra" / "overrides.yaml").read_text()
    assert "distributed.process_id=0" in overrides
    # Both processes evaluated at the end (a collective program); process 0 logged it.
    assert sorted(scalars(baseline / "tb", "eval/loss")) == [12]
    assert "Eval at step 12" in (baseline / "train.process-1.log").read_text()


@pytest.mark.slow
def test_a_2x4_checkpoint_restores_onto_1x8_and_back(baseline, tmp_path):
    # 2 processes x 4 devices -> 1 process x 8 devices: the restore checks every array
    # against the checksums saved with it, so it is bitwise; training goes on equivalently
    # (gloo and XLA:CPU sum the shards in different orders: close, not bitwise).
    one = tmp_path / "one"
    resume = f"trainer.resume_from={baseline}/checkpoints/4"
    run_train(*SMALL, *STEPS, resume, f"hydra.run.dir={one}", cwd=tmp_path)
    assert "Restored step 4 from" in (one / "train.log").read_text()
    a, b = load_arrays(baseline / "checkpoints" / "12"), load_arrays(one / "checkpoints" / "12")
    for key, value in a.items():
        np.testing.assert_allclose(b[key], value, rtol=1e-5, atol=1e-6, err_msg=key)

    # ... and back onto 2 processes: nothing left to train, so the final checkpoint it
    # saves is the restored state, which must be bitwise the one saved on 1 x 8.
    back = tmp_path / "back"
    run(back, *STEPS, f"trainer.resume_from={one}/checkpoints/12", tmp=tmp_path, name="back")
    assert_bitwise_equal(load_arrays(back / "checkpoints" / "12"), b)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_resume_is_bitwise(
    baseline, tmp_path
):
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"first.p{pid}.log" for pid in range(PROCESSES)]
    procs = start_run(run_dir, *STEPS, *PACED, logs=logs)
    wait_until(
        lambda: (
            4 in complete_steps(run_dir / "checkpoints") or any(p.poll() is not None for p in procs)
        ),
        180,
        "the checkpoint of step 4",
    )
    procs[1].send_signal(signal.SIGTERM)  # process 1 only
    assert finish(procs, logs) == [EXIT_PREEMPTED] * PROCESSES, tail(logs[0]) + tail(logs[1])
    stopped = [logged_step(log) for log in logs]
    assert stopped[0] == stopped[1] and 4 < stopped[0] < 12
    assert complete_steps(run_dir / "checkpoints")[-1] == stopped[0]  # one checkpoint, there
    assert "a stop signal to process 1" in logs[0].read_text()
    assert "Stopped by SIGTERM at step" in logs[1].read_text()

    logs = run(run_dir, *STEPS, tmp=tmp_path, name="rerun")
    assert f"Restored step {stopped[0]} from" in logs[0].read_text()
    assert_bitwise_equal(
        load_arrays(run_dir / "checkpoints" / "12"), load_arrays(baseline / "checkpoints" / "12")
    )


@pytest.mark.slow
def test_a_killed_process_ends_the_other_in_bounded_time_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    steps = ["trainer.steps=40", "checkpoint.every_steps=4", "distributed.heartbeat_timeout_s=5"]
    logs = [tmp_path / f"first.p{pid}.log" for pid in range(PROCESSES)]
    procs = start_run(run_dir, *steps, *PACED, logs=logs)
    wait_until(
        lambda: complete_steps(run_dir / "checkpoints") or procs[0].poll() is not None,
        180,
        "a first checkpoint",
    )
    procs[1].kill()  # kill -9
    killed = time.monotonic()
    status = finish(procs, logs, timeout=60)[0]
    assert time.monotonic() - killed < 5 + 15  # the heartbeat timeout, then a few polls
    text = logs[0].read_text()
    if status == -signal.SIGABRT:
        # Gloo noticed first: the peer vanished in the middle of a collective's message, and
        # gloo aborts the process itself (docs/multihost.md, known limits). Seen under load.
        assert "[enforce fail at external/gloo" in text, tail(logs[0])
    else:
        assert status == EXIT_PEER_LOST, tail(logs[0])
        lines = [ln for ln in text.splitlines() if ln.startswith("xshard: error:")]
        assert len(lines) == 1 and "Lost process 1" in lines[0], tail(logs[0])
        assert "no heartbeat for" in lines[0] and "Last complete checkpoint: step" in lines[0]

    last = complete_steps(run_dir / "checkpoints")[-1]
    load_arrays(run_dir / "checkpoints" / str(last))  # the last complete checkpoint is valid
    more = f"trainer.steps={last + 2}"
    logs = run(run_dir, more, "checkpoint.every_steps=4", tmp=tmp_path, name="rerun")
    assert f"Restored step {last} from" in logs[0].read_text()
    assert complete_steps(run_dir / "checkpoints")[-1] == last + 2


@pytest.mark.slow
def test_killing_process_0_ends_process_1_at_once(tmp_path):
    # Process 0 hosts JAX's coordinator: when it dies, JAX aborts the others itself, at once
    # (docs/multihost.md, known limits): the status and message are JAX's.
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    procs = start_run(run_dir, "trainer.steps=40", "checkpoint.every_steps=4", *PACED, logs=logs)
    wait_until(
        lambda: complete_steps(run_dir / "checkpoints") or procs[1].poll() is not None,
        180,
        "a first checkpoint",
    )
    procs[0].kill()
    killed = time.monotonic()
    assert finish(procs, logs, timeout=60)[1] not in (0, None), tail(logs[1])
    assert time.monotonic() - killed < 20
    # Whichever of JAX's runtimes notices first ends it: the coordination service (the leader
    # task is gone) or gloo (a collective whose peer vanished mid-message).
    text = logs[1].read_text()
    assert "leader task" in text or "[enforce fail at external/gloo" in text, tail(logs[1])


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (user mount namespaces)")
def test_processes_that_do_not_share_the_run_dir_refuse_to_start(tmp_path):
    # Process 1 runs in its own mount namespace with an empty tmpfs over the run dir's parent:
    # the same path, another filesystem, as on two hosts without a shared disk.
    shared = tmp_path / "shared"
    shared.mkdir()
    port = free_port()
    args = [
        [*SMALL, "trainer.steps=4", *distributed(port, pid), f"hydra.run.dir={shared / 'run'}"]
        for pid in range(PROCESSES)
    ]
    hide = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs none {shared} && exec "$@"', "sh"]
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    codes = finish(start(logs, args, prefix=[[], hide]), logs, timeout=120)
    assert codes == [2, 2], tail(logs[0]) + tail(logs[1])
    mine = logs[1].read_text()
    assert (
        f"paths.checkpoint_dir='{shared / 'run' / 'checkpoints'}' (process 0's) is not shared"
        in mine
    )
    assert f"its own run dir is {shared / 'run'}" in mine
    assert "process 1 " in logs[0].read_text() and "failed at checking" in logs[0].read_text()
    assert not complete_steps(shared / "run" / "checkpoints")


SLURM_DOCTOR = [*SMALL, "distributed.enabled=true", "distributed.cpu_collectives=gloo"]


@pytest.mark.slow
def test_slurm_detection_forms_one_8_device_mesh_of_two_local_processes(tmp_path):
    # The variables JAX's SLURM detection reads (jax/_src/clusters/slurm_cluster.py); the
    # coordinator is the first host of the step's node list on a port from the job id
    # (JAX_COORDINATOR_PORT overrides the port, so that parallel test runs do not collide).
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(PROCESSES),
        "JAX_COORDINATOR_PORT": str(free_port()),
    }
    procs = []
    for pid in range(PROCESSES):
        env = {**slurm, "SLURM_PROCID": str(pid), "SLURM_LOCALID": str(pid)}
        args = [*SLURM_DOCTOR, f"hydra.run.dir={tmp_path / 'run'}"]
        procs += start([logs[pid]], [args], module="trainers.doctor", env=env)
    assert finish(procs, logs, timeout=180) == [0, 0], tail(logs[0]) + tail(logs[1])
    report = logs[0].read_text()
    assert "auto-detected: slurm: 2 processes, coordinator localhost:" in report
    assert "process 0:   " in report and "4 local cpu device(s)" in report
    assert "devices:     8 cpu device(s) in all" in report
    assert "mesh=cpu8: {'data': 8}" in report and "4 per shard, 8 shards" in report
    assert "shared, writable by all 2 processes (OK)" in report and "All checks passed." in report
    assert "see process 0's report" in logs[1].read_text()


def doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m trainers.doctor ARGS` in one process."""
    cmd = [sys.executable, "-m", "trainers.doctor", *SMALL, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.slow
def test_doctor_on_one_process_lists_the_problems_and_exits_2(tmp_path):
    ok = doctor(f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "one process (distributed.enabled=false)" in ok.stdout
    assert "All checks passed." in ok.stdout
    assert not list((tmp_path / "run").rglob("*"))  # no config dump, lock, log or checkpoint
    default = doctor(cwd=tmp_path)  # Hydra's timestamped outputs/<date>/<time>: removed
    assert default.returncode == 0, default.stdout + default.stderr
    assert not (tmp_path / "outputs").exists()

    readonly = tmp_path / "ro"
    readonly.mkdir(mode=0o555)
    bad = doctor(
        "trainer.batch_size=30",
        f"paths.checkpoint_dir={readonly}/c",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "trainer.batch_size=30 is not divisible by the data-parallel size 8" in bad.stdout
    if os.geteuid() != 0:  # root writes anywhere
        assert "paths.checkpoint_dir=" in bad.stdout
    assert "problem(s):" in bad.stdout


@pytest.mark.slow
def test_doctor_on_two_processes_lists_a_problem_they_share_once(tmp_path):
    port = free_port()
    logs = [tmp_path / f"p{pid}.log" for pid in range(PROCESSES)]
    args = [
        [*SMALL, "trainer.batch_size=30", *distributed(port, pid), f"hydra.run.dir={tmp_path}/r"]
        for pid in range(PROCESSES)
    ]
    assert finish(start(logs, args, module="trainers.doctor"), logs, 180) == [2, 2]
    report = logs[0].read_text()
    assert "explicit (distributed.*): 2 processes" in report and "1 problem(s):" in report
    assert "  - trainer.batch_size=30 is not divisible by the data-parallel size 8" in report


@pytest.mark.slow
def test_sweep_over_mesh_sizes_runs_each_job_in_its_own_process(tmp_path):
    proc = run_train(
        "-m",
        "hydra/launcher=submitit_local",
        "mesh=cpu8,cpu4x2,cpu4",
        "task=mlp",
        "trainer.steps=2",
        "trainer.batch_size=16",
        "checkpoint=none",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        cwd=tmp_path,
    )
    shapes = {}
    for log in (tmp_path / "sweep").glob("*/train.log"):
        found = re.search(r"mesh=(\w+): axes .* shape (\([0-9, ]+\))", log.read_text())
        assert found and "Run completed (done) at step 2 of 2" in log.read_text(), log.read_text()
        shapes[found.group(1)] = found.group(2)
    assert shapes == {"cpu8": "(8,)", "cpu4x2": "(4, 2)", "cpu4": "(4,)"}, proc.stdout


@pytest.mark.slow
def test_sigusr2_stops_a_run_cleanly(tmp_path):
    # What SLURM sends through submitit before the time limit (trainer.stop_signals).
    run_dir = tmp_path / "run"
    log = tmp_path / "log"
    args = [*SMALL, "trainer.steps=40", "checkpoint.every_steps=4", *PACED]
    args.append(f"hydra.run.dir={run_dir}")
    (proc,) = start([log], [args])
    wait_until(
        lambda: complete_steps(run_dir / "checkpoints") or proc.poll() is not None,
        180,
        "a first checkpoint",
    )
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=120) == EXIT_PREEMPTED, tail(log)
    assert re.search(r"preempted: Stopped by SIGUSR2 at step \d+ of 40", log.read_text())
