"""An override that does not fit the schema is one line naming it, what the schema expects and,
for an unknown key, the node's keys (`trainers.app.override_errors`), in-process through
Hydra's compose API; the CLI's exit 2 and one line: test_bad_values.py."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from trainers.app.override_errors import readable_overrides


def _error(*overrides: str, capsys) -> str:
    with readable_overrides(2), initialize_config_module("xshard.conf", version_base="1.3"):
        with pytest.raises(SystemExit) as exited:
            compose("xshard_train", overrides=list(overrides))
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "optimizer.learning_rate=fast",
            "optimizer.learning_rate=fast: Value 'fast' of type 'str' could not be converted to "
            "Float, the type of optimizer.learning_rate in AdamWConf",
        ),
        (
            "reduction.skip_nonfinite=maybe",
            "reduction.skip_nonfinite=maybe: Value 'maybe' is not a valid bool (type str), the "
            "type of reduction.skip_nonfinite in ReductionConf",
        ),
        (
            "optimizer.lr=0.1",
            "optimizer.lr=0.1: unknown key. Allowed keys: ['_target_', 'learning_rate', 'b1',",
        ),
        ("stepz=1", "stepz=1: unknown key. Allowed keys: ['hydra', 'trainer', 'distributed',"),
        ("~optimizer.nope", "~optimizer.nope: Could not delete from config. 'optimizer.nope'"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(override, message, capsys):
    # The good overrides before it apply; the line names the one that failed.
    line = _error("seed=3", override, "trainer.steps=5", capsys=capsys)
    assert line.startswith(f"xshard: error: {message}"), line


def test_good_overrides_apply_and_hydra_is_restored_after():
    apply = ConfigLoaderImpl._apply_overrides_to_config
    with readable_overrides(2), initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose("xshard_train", overrides=["optimizer.learning_rate=0.5", "seed=3"])
    assert cfg.optimizer.learning_rate == 0.5 and cfg.seed == 3
    assert ConfigLoaderImpl._apply_overrides_to_config is apply
