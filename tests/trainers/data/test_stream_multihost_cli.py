"""Streaming data on two processes, through the real CLI (slow): the example repo's Grain
`IterDataset` task (examples/experiment_repo, ``task=regression_stream``) on two local
processes x 4 CPU devices over gloo (tests/multihost_cli.py). Each process reads its own shard
and saves its own iterator state in every checkpoint; both processes killed with SIGKILL
mid-run and rerun end bitwise equal to an uninterrupted 2-process run. The same run's eval
split (200 examples in batches of 48: process 1's share of the last batch is empty) is scored
exactly once, as on 1 process x 8 devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import scalars
from tests.multihost_cli import (
    PROCESSES,
    distributed,
    finish,
    free_port,
    load_arrays,
    start,
    tail,
)
from tests.reliability_helpers import assert_bitwise_equal, wait_until
from trainers.checkpoint.io import complete_steps

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.multiprocess]

EXAMPLE = REPO / "examples" / "experiment_repo"
STEPS, EVERY = 15, 5
ARGS = [
    "--config-dir",
    str(EXAMPLE / "conf"),
    "task=regression_stream",
    "+allowed_targets=[my_experiments.,tests.]",
    "mesh=cpu8",
    "trainer.batch_size=32",
    "trainer.eval_batch_size=48",
    "trainer.progress=false",
    "trainer.log_every=1",
    "schedule=constant",
    f"trainer.steps={STEPS}",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep=null",
]
#: Steps paced so that the kill lands mid-run (the pace changes no number).
PACED = ["trainer.hooks=[{_target_:tests.multihost_hooks.Pace,seconds:0.4}]"]
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(REPO)])}


def start_run(run: Path, logs: list[Path], *overrides: str) -> list[subprocess.Popen]:
    port = free_port()
    args = [
        [*ARGS, *overrides, *distributed(port, pid), f"hydra.run.dir={run}"]
        for pid in range(PROCESSES)
    ]
    return start(logs, args, env=ENV)


def run_to_end(run: Path, tmp: Path, name: str, *overrides: str) -> list[Path]:
    logs = [tmp / f"{name}.p{pid}.log" for pid in range(PROCESSES)]
    codes = finish(start_run(run, logs, *overrides), logs)
    assert codes == [0] * PROCESSES, tail(logs[0]) + tail(logs[1])
    return logs


def data_states(step_dir: Path) -> list[str]:
    """Each process's saved iterator state in a checkpoint step."""
    return [
        (step_dir / "data" / f"process_{pid}-of-{PROCESSES}.json").read_text()
        for pid in range(PROCESSES)
    ]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run: checkpoints 5, 10, 15."""
    tmp = tmp_path_factory.mktemp("stream_baseline")
    run_to_end(tmp / "run", tmp, "baseline")
    assert complete_steps(tmp / "run" / "checkpoints") == [5, 10, 15]
    return tmp / "run"


def test_each_process_saves_its_own_shards_position(baseline):
    for step in (5, 10, 15):
        states = [json.loads(s) for s in data_states(baseline / "checkpoints" / str(step))]
        # Each shard read 16 rows a step, plus the examples its filter dropped: its own count.
        assert all(s["next_index"] >= 16 * step for s in states)
    final = [json.loads(s)["next_index"] for s in data_states(baseline / "checkpoints" / "15")]
    assert max(final) > 16 * STEPS  # a filter dropped examples: not a function of the step


def test_kill_9_of_both_processes_then_rerun_is_bitwise_an_uninterrupted_run(baseline, tmp_path):
    run = tmp_path / "run"
    logs = [tmp_path / f"killed.p{pid}.log" for pid in range(PROCESSES)]
    procs = start_run(run, logs, *PACED)
    try:
        wait_until(
            lambda: (
                bool(complete_steps(run / "checkpoints"))
                or any(p.poll() is not None for p in procs)
            ),
            240,
            f"the checkpoint of step {EVERY}",
        )
        for proc in procs:
            proc.kill()  # SIGKILL: no handler runs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
    last = complete_steps(run / "checkpoints")[-1]
    assert EVERY <= last < STEPS, tail(logs[0])

    logs = run_to_end(run, tmp_path, "rerun")
    assert f"Restored step {last} from" in logs[0].read_text()
    for log in ("train.log", "train.process-1.log"):  # each process, its own shard's position
        assert "Restored the data iterator's state from" in (run / log).read_text(), log

    final = f"checkpoints/{STEPS}"
    assert_bitwise_equal(load_arrays(run / final), load_arrays(baseline / final))
    assert data_states(run / final) == data_states(baseline / final)
    want, got = scalars(baseline / "tb", "train/loss"), scalars(run / "tb", "train/loss")
    assert all(got[s] == want[s] for s in range(last + 1, STEPS + 1))


def test_eval_split_scored_once_as_on_one_process(baseline):
    result = json.loads((baseline / "result.json").read_text())
    assert result["eval_step"] == STEPS
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.evaluate",
            str(baseline),
            "+allowed_targets=[my_experiments.,tests.]",
        ],
        cwd=REPO,
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((baseline / f"eval_step{STEPS}.json").read_text())
    assert record["examples"] == 200
    assert set(record["metrics"]) == set(result["eval"])
    for name, value in record["metrics"].items():
        assert result["eval"][name] == pytest.approx(value, abs=1e-6), name
