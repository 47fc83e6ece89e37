"""Data options through the real CLI (all slow): a built-in task on the user's own file, every
bad file one line and exit 2, and docs/tasks.md's Grain task resumed mid-epoch after SIGTERM
bitwise equal to an uninterrupted run."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests import REPO
from tests.cli import run_train, scalars
from tests.reliability_helpers import assert_bitwise_equal, load_state
from tests.trainers.data.test_data_files import write_files
from trainers.checkpoint.resume import complete_steps
from trainers.exits import EXIT_PREEMPTED

pytestmark = pytest.mark.long

DOC = REPO / "docs" / "tasks.md"
QUIET = ["trainer.layer_stats_every=0", "trainer.histogram_every=0", "trainer.log_every=1"]


def _block(language: str, first_line: str) -> str:
    for body in re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.DOTALL):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no {language} block starting with {first_line!r} in {DOC}")


@pytest.mark.slow
def test_mlp_trains_on_a_npz_for_num_epochs(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 8)).astype(np.float32)
    np.savez(tmp_path / "mine.npz", features=x, labels=x @ rng.standard_normal((8, 2)))
    run = tmp_path / "run"
    proc = run_train(
        "task=mlp",
        "task.data.path=mine.npz",  # relative to the working directory
        "task.data.keys={x: features, y: labels}",
        "task.data.num_epochs=3",
        "task.in_dim=8",
        "task.out_dim=2",
        "trainer.batch_size=16",
        "trainer.steps=1000",
        "schedule=constant",
        "optimizer.learning_rate=0.01",
        *QUIET,
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert "The data ran out after step 18 of trainer.steps=1000" in proc.stderr + proc.stdout
    assert complete_steps(run / "checkpoints")[-1] == 18  # 3 epochs of 100 // 16 steps
    mse = scalars(run / "tb", "train/mse")
    assert sorted(mse) == list(range(1, 19)) and mse[18] < 0.5 * mse[1]  # it learns


@pytest.mark.slow
def test_tiny_gpt_trains_on_a_text_file(tmp_path):
    (tmp_path / "book.txt").write_text("It was the best of times, it was the worst of times. " * 50)
    run = tmp_path / "run"
    run_train(
        "task=tiny_gpt",
        f"task.data.path={tmp_path / 'book.txt'}",
        "task.seq_len=32",
        "task.d_model=32",
        "task.n_layers=1",
        "task.d_ff=64",
        "trainer.batch_size=16",
        "trainer.steps=6",
        "checkpoint=none",
        *QUIET,
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert sorted(scalars(run / "tb", "train/loss")) == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.data.path=missing.npz"], "task.data.path='missing.npz': no such file"),
        (["task.data.path=good.npz", "task.data.keys={x: f}"], "has no array 'f' for batch key"),
        (["task.data.path=narrow.npz"], "has shape (40, 8); task=mlp expects (n, 16)"),
        (["task.data.path=strings.npz"], "has dtype <U1; expected real numbers"),
        (["task.data.path=few.npz"], "has 5 examples, fewer than one global batch of 16"),
        (["task.data.path=table.csv"], "unsupported file type .csv"),
        (["task.data.path=good.npz", "task.data.shuffle=maybe"], "task.data.shuffle='maybe'"),
        (["task=tiny_gpt", "task.data.path=latin.txt"], "token 195 at offset 3 is outside"),
        # Untrusted files (tests/trainers/data/test_data_files.py write_untrusted_files).
        (
            ["task.data.path=forged.npz"],
            (
                "task.data.path='forged.npz': array 'x' declares shape (8589934592, 16) of float64 "
                "(1 TiB), over the task.data.max_bytes=4294967296 (4 GiB)"
            ),
        ),
        (
            ["task=tiny_gpt", "task.data.path=ids_wide.npy"],
            (
                "task.data.path='ids_wide.npy': token 4294967301 at offset 7 is outside [0, "
                "task.vocab_size=128)"
            ),
        ),
        (["task.data.path=huge.npz"], "x (huge.npz:x) has 1e+300 at row 3 (index (3, 5))"),
        (["task.data.path=random.npz"], "task.data.path='random.npz': not a .npz file"),
        (["task.data.path=folder.npz"], "task.data.path='folder.npz' is a directory"),
        (["task.data.path=pipe.npz"], "task.data.path='pipe.npz' is a FIFO (named pipe)"),
        (["task=tiny_gpt", "task.data.path=zero.npy"], "'zero.npy' is a character device"),
    ],
)
def test_cli_bad_data_exits_2_with_one_line(tmp_path, overrides, message):
    write_files(tmp_path)
    proc = run_train(
        "task=mlp",
        "checkpoint=none",
        "trainer.steps=2",
        "trainer.batch_size=16",
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
        timeout=300,  # a FIFO opened for reading would block: fail, never hang
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    assert message in lines[0] and len(lines[0]) < 600
    assert "Traceback" not in proc.stderr + proc.stdout


HOOK = '''
import os
import signal

from trainers import Hook


class TermAt(Hook):
    """Sends SIGTERM to its own process when it sees step `step`'s metrics."""

    def __init__(self, step: int):
        self.step = step

    def on_step(self, step, metrics):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
'''


@pytest.mark.slow
def test_grain_task_resumes_mid_epoch_bitwise(tmp_path):
    """docs/tasks.md's Grain task: 200 examples, batch 16, so 12 steps per epoch; stopped by
    SIGTERM mid-epoch, the resumed run ends bitwise equal to an uninterrupted one."""
    repo = tmp_path / "my_repo"
    (repo / "conf" / "task").mkdir(parents=True)
    (repo / "my_grain_task.py").write_text(_block("python", "# my_repo/my_grain_task.py"))
    (repo / "my_hooks.py").write_text(HOOK)
    (repo / "conf" / "task" / "grain_linreg.yaml").write_text(
        _block("yaml", "# my_repo/conf/task/grain_linreg.yaml")
    )
    common = [
        f"--config-dir={repo / 'conf'}",
        "task=grain_linreg",
        "+allowed_targets=[my_grain_task.,my_hooks.]",
        "trainer.batch_size=16",
        "trainer.steps=40",  # 3 epochs and a third: reshuffles after the resume too
        "checkpoint.every_steps=100",  # only the stop and the end save
        *QUIET,
    ]
    env = {"PYTHONPATH": str(repo)}
    baseline, run = tmp_path / "baseline", tmp_path / "run"
    run_train(*common, f"hydra.run.dir={baseline}", cwd=tmp_path, env=env)

    stopped = run_train(
        *common,
        "trainer.hooks=[{_target_: my_hooks.TermAt, step: 17}]",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    (step,) = complete_steps(run / "checkpoints")
    assert 17 <= step < 24 and step % 12, step  # mid-epoch (epoch 1)

    resumed = run_train(*common, f"hydra.run.dir={run}", cwd=tmp_path, env=env)
    assert f"Restored step {step} from" in resumed.stdout + resumed.stderr
    assert_bitwise_equal(
        load_state(run / "checkpoints" / "40"), load_state(baseline / "checkpoints" / "40")
    )
    assert scalars(run / "tb", "train/loss") == scalars(baseline / "tb", "train/loss")
