"""docs/hooks.md's example hooks (early stopping on eval loss, a JSON-lines logger) run as
written, through the real CLI: the run stops early, evaluates and saves at the step it
stopped, and the logger got every evaluation."""

from __future__ import annotations

import json
import re

import pytest

from tests import REPO
from tests.cli import run_train
from trainers.checkpoint.io import complete_steps

DOC = REPO / "docs" / "hooks.md"


def _block(first_line: str) -> str:
    for body in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        if body.startswith(first_line):
            return body
    raise AssertionError(f"no python block starting with {first_line!r} in {DOC}")


@pytest.mark.slow
def test_the_documented_early_stopping_hook_and_logger(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "my_hooks.py").write_text(_block("# my_hooks.py"))
    run, lines = tmp_path / "run", tmp_path / "metrics.jsonl"
    run_train(
        "task=mlp",
        "mesh=cpu8",
        "trainer.batch_size=16",
        "trainer.steps=200",
        "trainer.eval_every=2",
        "trainer.eval_batches=1",
        "checkpoint.every_steps=1000",
        "optimizer.learning_rate=3.0",  # too high: eval loss stops improving at once
        "+allowed_targets=[my_hooks.]",
        "trainer.hooks=[{_target_: my_hooks.PlateauStop, patience: 2}, "
        f"{{_target_: my_hooks.JsonLines, path: '{lines}'}}]",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(repo)},
    )
    result = json.loads((run / "result.json").read_text())
    stopped = result["last_step"]
    assert result["status"] == "completed" and stopped < 200
    assert result["eval_step"] == stopped  # evaluated once more where it stopped
    assert complete_steps(run / "checkpoints") == [stopped]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    evals = [r["step"] for r in records if "eval/loss" in r]
    assert evals[-1] == stopped and evals[:-1] == list(range(2, stopped, 2))
    assert records[-1] == {"step": stopped, "reason": "stopped"}
