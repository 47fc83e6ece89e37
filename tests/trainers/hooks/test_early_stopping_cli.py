"""Early stopping through the real CLI (``trainer.early_stopping.*``): the run stops when its
metric stops improving, evaluates once more and saves a checkpoint at the step it stopped;
bad values are one line, exit 2. The hook itself, in process, on eval and train metrics."""

from __future__ import annotations

import json

import pytest

from tests.cli import refused, run_train, scalars
from trainers.checkpoint.io import complete_steps
from trainers.config.early_stopping import EarlyStoppingOptions
from trainers.hooks.early_stopping import EarlyStopping
from xshard.errors import ConfigError

COMMON = (
    "task=mlp",
    "mesh=cpu8",
    "trainer.batch_size=16",
    "trainer.steps=50",
    "trainer.log_every=1",
    "trainer.eval_batches=1",
    "trainer.eval_every=2",
    "checkpoint.every_steps=100",
)


@pytest.mark.slow
def test_early_stopping_on_eval_loss_stops_evaluates_and_saves_there(tmp_path):
    run = tmp_path / "run"
    proc = run_train(
        *COMMON,
        # Nothing after the first evaluation improves by 1e9: evaluations 4 and 6 are the two
        # without an improvement; the stop asked at step 6 ends the run after step 7.
        "trainer.early_stopping.metric=eval/loss",
        "trainer.early_stopping.patience=2",
        "trainer.early_stopping.min_delta=1e9",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0
    log = (run / "train.log").read_text()
    assert "Early stopping at step 6: eval/loss=" in log
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "completed" and result["last_step"] == 7
    assert result["eval_step"] == 7  # the final evaluation is of the step it stopped at
    assert sorted(scalars(run / "tb", "eval/loss")) == [2, 4, 6, 7]
    assert sorted(scalars(run / "tb", "hparams/final_eval/loss")) == [7]
    assert complete_steps(run / "checkpoints") == [7]


@pytest.mark.slow
def test_an_eval_metric_the_run_does_not_have_is_refused(tmp_path):
    result = run_train(
        *COMMON,
        "trainer.early_stopping.metric=eval/accuracy",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    refused(result, "trainer.early_stopping.metric='eval/accuracy'", "'eval/loss'")


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("metric", "loss", "expected 'eval/<metric>'"),
        ("mode", "lowest", "expected one of ['min', 'max']"),
        ("patience", 0, "expected an integer >= 1"),
        ("min_delta", -1.0, "expected a finite number >= 0"),
    ],
)
def test_bad_values_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError, match=rf"trainer\.early_stopping\.{key}=") as e:
        EarlyStoppingOptions(**{"metric": "eval/loss", key: value})
    assert fragment in str(e.value)


def test_a_train_metric_is_checked_every_step_and_nan_never_improves():
    hook = EarlyStopping(EarlyStoppingOptions(metric="train/acc", mode="max", patience=2))
    for step, acc in enumerate([0.5, 0.6, float("nan"), 0.6], start=1):
        hook.on_step(step, {"train/acc": acc, "train/loss": 1.0})
        hook.on_eval(step, {"eval/loss": 0.0})  # another kind of metric: ignored
    assert hook.wants_stop() and hook.stopped_at == 4
    assert (hook.best, hook.best_step) == (0.6, 2)
    with pytest.raises(ConfigError, match=r"train/acc.*\['train/loss'\]"):
        EarlyStopping(EarlyStoppingOptions(metric="train/acc")).on_step(1, {"train/loss": 1.0})
