"""Exact evaluation across processes, through the real CLI (slow): two local processes x 4 CPU
devices over gloo (tests/multihost_cli.py) evaluate a finite eval split of 359 examples that
each process reads from its own files (tests/multihost_tasks.py):

- files of 200, 100 and 59 examples: process 0 reads 259 examples in 9 batches of 32 rows
  (the last short), process 1 100 in 4 (the last short), so process 1 pads 5 batches;
- one file of 359 examples: process 1 has no batch at all, and pads all 12 like process 0's.

Every example is scored exactly once in total: ``eval/loss`` and ``eval/accuracy`` equal a
NumPy reference over the whole split, and ``python -m trainers.evaluate`` of the same
checkpoint on 1 process x 8 devices (6 batches of 64, the last short).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests import REPO
from tests.multihost_cli import distributed, finish, free_port, load_arrays, start, tail
from tests.multihost_tasks import numpy_reference
from trainers.checkpoint.io import complete_steps

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

EVAL_BATCH = 64  # 32 rows per process
ARGS = [
    "mesh=cpu8",
    "~task",
    "+task={_target_:tests.multihost_tasks.FilesEvalClassifier}",
    "+allowed_targets=[tests.]",
    "optimizer.learning_rate=0.05",
    "trainer.batch_size=32",
    f"trainer.eval_batch_size={EVAL_BATCH}",
    "trainer.eval_batches=20",
    "trainer.progress=false",
]


class Run(NamedTuple):
    path: Path
    files: tuple[int, ...]
    steps: int
    batches: int  # eval batches every process runs: the most any process has


@pytest.fixture(
    scope="module",
    params=[((200, 100, 59), 4, 9), ((359,), 1, 12)],
    ids=["uneven-files", "process-1-has-none"],
)
def run(request, tmp_path_factory) -> Run:
    """A 2-process run, evaluated at its end."""
    files, steps, batches = request.param
    tmp = tmp_path_factory.mktemp("exact_eval")
    path = tmp / "run"
    args = [*ARGS, f"+task.files=[{','.join(map(str, files))}]", f"trainer.steps={steps}"]
    port = free_port()
    logs = [tmp / f"p{pid}.log" for pid in range(2)]
    codes = finish(
        start(logs, [[*args, *distributed(port, p), f"hydra.run.dir={path}"] for p in range(2)]),
        logs,
    )
    assert codes == [0, 0], tail(logs[0]) + tail(logs[1])
    assert complete_steps(path / "checkpoints")[-1] == steps
    return Run(path, files, steps, batches)


def two_process_eval(run: Run) -> dict[str, float]:
    """The final evaluation of the 2-process run, as its summary recorded it (float64)."""
    result = json.loads((run.path / "result.json").read_text())
    assert result["eval_step"] == run.steps
    return result["eval"]


def test_every_example_is_scored_once_across_processes(run):
    compiled = f"Compiled the eval step ({run.batches} batches of {EVAL_BATCH})"
    for log in ("train.log", "train.process-1.log"):  # the same number on both: one pads
        assert compiled in (run.path / log).read_text(), log
    assert f"({sum(run.files)} examples)" in (run.path / "train.log").read_text()
    params = load_arrays(run.path / "checkpoints" / str(run.steps))
    want = numpy_reference(params["['params']['w']"], params["['params']['b']"], run.files)
    got = two_process_eval(run)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name


def test_equals_the_evaluation_on_one_process_of_8_devices(run):
    proc = subprocess.run(
        [sys.executable, "-m", "trainers.evaluate", str(run.path), "+allowed_targets=[tests.]"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((run.path / f"eval_step{run.steps}.json").read_text())
    assert record["examples"] == sum(run.files)
    got = two_process_eval(run)
    assert set(record["metrics"]) == set(got)
    for name, value in record["metrics"].items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
