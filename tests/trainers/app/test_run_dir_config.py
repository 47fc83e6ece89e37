"""A run dir's saved config read back with the user's overrides (trainers/app/run_dir_config.py):
each override's key and value as Hydra's parser reads them (`override_assignment`), a line that
assigns no one value refused with one line naming it."""

from __future__ import annotations

import pytest
import yaml

from trainers.app.run_dir_config import CHECKPOINTS, CONFIG_FILE, read_run_config
from trainers.config.cli_args import override_assignment
from xshard.errors import ConfigError


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / CONFIG_FILE).parent.mkdir()
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump({"trainer": {"steps": 6, "seed": 1}}))
    (tmp_path / CHECKPOINTS).mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "line, assigned",
    [
        ("trainer.steps=7", ("trainer.steps", 7)),
        ("+extra.key=[1,2]", ("extra.key", [1, 2])),
        ("++trainer.name='a b'", ("trainer.name", "a b")),
        ("trainer.seed=null", ("trainer.seed", None)),
        ("trainer.steps", None),  # no "="
        ("=3", None),  # no key
        ("~trainer", None),  # a deletion
        ("trainer.steps=1,2", None),  # a sweep
    ],
)
def test_an_override_is_read_as_hydra_reads_it(line, assigned):
    assert override_assignment(line) == assigned


def test_overrides_apply_to_the_saved_config(run_dir):
    cfg = read_run_config(run_dir, ["trainer.steps=7", "+trainer.eval_batches=20"])
    assert cfg.trainer.steps == 7 and cfg.trainer.eval_batches == 20 and cfg.trainer.seed == 1
    assert cfg.paths.checkpoint_dir == str(run_dir / CHECKPOINTS)


@pytest.mark.parametrize("line", ["trainer.steps", "=7", "+=7", "~trainer"])
def test_a_malformed_override_is_one_line(run_dir, line):
    with pytest.raises(ConfigError) as error:
        read_run_config(run_dir, [line])
    assert str(error.value) == f"override {line!r}: expected key=value."
