"""sharding.zero_stage from the command line: a run end to end, bad values (exit 2, one line),
and checkpoints of sharded state restored across shard counts and onto ZeRO off, each run in
its own process with its own simulated device count (mesh=cpu8 / mesh=cpu4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.cli import run_train, scalars

pytestmark = pytest.mark.long

COMMON = ("task=mlp", "trainer.batch_size=32", "trainer.log_every=1", "checkpoint.async_save=false")


def train_in(run_dir: Path, *overrides: str, check: bool = True):
    return run_train(
        *COMMON, *overrides, f"hydra.run.dir={run_dir}", cwd=run_dir.parent, check=check
    )


def losses(run_dir: Path) -> dict[int, float]:
    return scalars(run_dir / "tb", "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("value", ["5", "x", "-1"])
def test_cli_bad_zero_stage_exits_2_with_one_line_naming_the_key(tmp_path, value):
    proc = train_in(
        tmp_path / "run",
        "checkpoint=none",
        "trainer.steps=1",
        f"sharding.zero_stage={value}",
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    assert "sharding.zero_stage=" in lines[0] and value in lines[0]


@pytest.mark.slow
def test_checkpoint_of_zero2_on_8_shards_restores_onto_4_back_onto_8_and_onto_zero_off(
    tmp_path,
):
    a, b, c, d = (tmp_path / name for name in "abcd")
    # A: ZeRO-2 on 8 data shards, the sharded state saved at step 4; its start-up report.
    train_in(a, "mesh=cpu8", "sharding.zero_stage=2", "trainer.steps=4")
    log = (a / "train.log").read_text()
    assert "sharding.zero_stage=2 over the data axes ['data'] (8 shards)" in log
    assert "Left replicated over the data axes: layers/2/b (4,)" in log
    # B: onto 4 shards (a process with 4 devices); C: back onto 8; D: onto ZeRO off.
    # Every restore compares the restored arrays with the checksums saved with them.
    train_in(b, "mesh=cpu4", "sharding.zero_stage=2", "trainer.steps=6", f"trainer.resume_from={a}")
    train_in(c, "mesh=cpu8", "sharding.zero_stage=2", "trainer.steps=8", f"trainer.resume_from={b}")
    train_in(d, "mesh=cpu8", "sharding.zero_stage=0", "trainer.steps=6", f"trainer.resume_from={a}")
    for run, step in ((b, 4), (c, 6), (d, 4)):
        assert f"Restored step {step}" in (run / "train.log").read_text()
    lb, lc, ld = losses(b), losses(c), losses(d)
    assert sorted(lb) == [5, 6] and sorted(lc) == [7, 8] and sorted(ld) == [5, 6]
    # The same global batch on 4 or 8 shards, ZeRO-2 or replicated: the same training.
    np.testing.assert_allclose([lb[5], lb[6]], [ld[5], ld[6]], rtol=1e-4)
