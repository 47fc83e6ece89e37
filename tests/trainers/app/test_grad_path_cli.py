"""``trainer.grad_impl=auto`` (the default) through the real CLI: the race's choice is written
to ``result.json``, to the checkpoints' config and to the compilation cache dir; a resume runs
that path without timing again (`trainers.app.grad_path`), and so does a new run of the same
programs (another learning rate: an input of the programs; `trainers.app.race_memory`)."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_train
from trainers.config.run import GRAD_IMPLS

pytestmark = pytest.mark.slow


def _result(run_dir):
    return json.loads((run_dir / "result.json").read_text())


def test_auto_records_its_choice_and_a_resume_or_rerun_keeps_it_untimed(tmp_path):
    run_dir = tmp_path / "run"
    # `run_train` pins one path unless told (tests.cli.ONE_PATH): the CLI's default, named.
    # A cache dir of this test's own: no other test's race is remembered there.
    common = (
        "task=mlp",
        "trainer.grad_impl=auto",
        "trainer.log_every=2",
        f"trainer.compilation_cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={run_dir}",
    )
    proc = run_train(*common, "trainer.steps=2", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    result = _result(run_dir)
    chosen = result["grad_impl"]
    assert chosen in GRAD_IMPLS
    race = result["grad_impl_race"]
    assert race["chosen"] == chosen and set(race["ms_per_step"]) == set(GRAD_IMPLS)
    assert race["seconds"] > 0 and race["steps_per_block"] >= 1
    assert f"trainer.grad_impl=auto: {chosen}, the faster plain step" in log
    saved = json.loads((run_dir / "checkpoints" / "2" / "metadata" / "metadata").read_text())
    assert saved["config"]["trainer"]["grad_impl"] == chosen  # what a resume will run

    proc = run_train(*common, "trainer.steps=4", cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert f"trainer.grad_impl=auto: {chosen}, the path of the checkpoint of step 2" in log
    assert "faster plain step" not in log  # not timed again
    assert "trainer.steps: 2 in the checkpoint, 4 now" in log  # the changes reported ...
    assert "trainer.grad_impl:" not in log  # ... do not include the path
    result = _result(run_dir)
    assert (result["grad_impl"], result["grad_impl_race"], result["last_step"]) == (chosen, None, 4)

    # A new run of the same programs (another learning rate) keeps the remembered choice.
    other = tmp_path / "other"
    proc = run_train(
        *common,
        "trainer.steps=2",
        "optimizer.learning_rate=0.05",
        f"hydra.run.dir={other}",
        "checkpoint=none",
        cwd=tmp_path,
    )
    log = proc.stdout + proc.stderr
    assert f"trainer.grad_impl=auto: {chosen}, the faster plain step when these programs" in log
    assert "medians of blocks" not in log  # not timed, and only the chosen path compiled:
    assert log.count("Compiled the train step") == 1 and "for levels 0, 1 in" in log
    result = _result(other)
    assert (
        result["grad_impl"] == chosen
        and result["grad_impl_race"]["ms_per_step"] == race["ms_per_step"]
    )
    remembered = result["grad_impl_race"]["remembered"]
    assert remembered.startswith(str(tmp_path / "cache" / "grad_impl_race")) and remembered in log
