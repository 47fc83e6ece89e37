"""Evaluation through the real CLI: eval/* in TensorBoard, HParams, the run summary and
result.json; trainer.objective; training bitwise equal with evaluation on and off."""

from __future__ import annotations

import json

import pytest

from tests.cli import hparams_dashboard, load_events, run_train, scalars
from tests.reliability_helpers import assert_bitwise_equal, load_state
from trainers.checkpoint.io import complete_steps

pytestmark = pytest.mark.slow

COMMON = (
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    "trainer.steps=4",
    "trainer.log_every=1",
    "trainer.eval_batches=2",
    "checkpoint.every_steps=3",
)


def test_eval_is_logged_returned_and_never_changes_training(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    proc = run_train(
        *COMMON,
        "trainer.eval_every=2",
        "trainer.objective=eval/loss",
        f"hydra.run.dir={on}",
        cwd=tmp_path,
    )
    run_train(*COMMON, "trainer.eval_batches=0", f"hydra.run.dir={off}", cwd=tmp_path)

    # Evaluation changes nothing in training: the same checkpoints, bitwise, and no extra
    # ones at the eval steps.
    assert complete_steps(on / "checkpoints") == complete_steps(off / "checkpoints") == [3, 4]
    for step in (3, 4):
        assert_bitwise_equal(
            load_state(on / "checkpoints" / str(step)), load_state(off / "checkpoints" / str(step))
        )
    assert scalars(on / "tb", "train/loss") == scalars(off / "tb", "train/loss")

    # TensorBoard: eval/* every trainer.eval_every steps and at the end.
    eval_loss = scalars(on / "tb", "eval/loss")
    assert sorted(eval_loss) == [2, 4]
    assert sorted(scalars(on / "tb", "eval/mse")) == [2, 4]
    final = scalars(on / "tb", "hparams/final_eval/loss")
    best = scalars(on / "tb", "hparams/best_eval/loss")
    assert final == {4: eval_loss[4]} and best[4] == min(eval_loss.values())
    dashboard = hparams_dashboard(on / "tb")
    assert {
        "hparams/final_loss",
        "hparams/final_eval/loss",
        "hparams/final_eval/mse",
        "hparams/best_eval/loss",
        "hparams/best_eval/mse",
    } <= set(dashboard["metrics"])
    assert not any(t.startswith("eval/") for t in load_events(off / "tb").Tags()["scalars"])
    assert "hparams/final_eval/loss" not in hparams_dashboard(off / "tb")["metrics"]

    # The run summary and result.json: final and best evaluation; the objective is eval/loss.
    result = json.loads((on / "result.json").read_text())
    assert result["objective_key"] == "eval/loss" and result["eval_step"] == 4
    assert result["objective"] == result["eval"]["eval/loss"] == pytest.approx(eval_loss[4])
    assert result["best_eval"]["eval/loss"] == pytest.approx(min(eval_loss.values()))
    assert "eval: final eval/loss" in proc.stdout + proc.stderr
    off_result = json.loads((off / "result.json").read_text())
    assert off_result["objective"] == off_result["final_loss"] and off_result["eval"] is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.objective=eval/accuracy"], "trainer.objective='eval/accuracy': the evaluation"),
        (["trainer.objective=eval/loss", "trainer.eval_batches=0"], "turns evaluation off"),
        (["trainer.eval_batch_size=12"], "trainer.eval_batch_size=12 is not divisible"),
    ],
    ids=["unknown-metric", "eval-off", "eval-batch"],
)
def test_bad_eval_config_exits_2_with_one_line(tmp_path, overrides, message):
    proc = run_train(*COMMON, "checkpoint=none", *overrides, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    assert message in lines[0]
