"""Bad input fails early: config errors through Hydra's compose API name the key and value;
targets outside the allowlist are refused before they are imported."""

from __future__ import annotations

import pytest

from trainers.exits import CheckpointError
from trainers.train import train
from xshard.errors import ConfigError

# --------------------------------------------------------------------------------------------
# In-process: bad input fails early with ConfigError naming the key and the value
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reduction.mode=max"], "reduction.mode: 'max'. Allowed: 'sum', 'mean'"),
        (["optimizer.learning_rate=-0.1"], "optimizer.learning_rate=-0.1"),
        (["optimizer.learning_rate=0"], "optimizer.learning_rate=0"),
        (["optimizer._target_=optax.adamx"], "optimizer._target_='optax.adamx' was not found"),
        (
            ["optimizer._target_=os.system"],
            "optimizer._target_='os.system' is not an allowed target",
        ),
        (["task._target_=os.system"], "task._target_='os.system' is not an allowed target"),
        (["+task.depth=3"], "task.depth: not an argument of trainers.tasks.mlp.MLPTask"),
        (["task.activation=swish"], "task.activation='swish'"),
        (["mesh=v4-8"], "mesh=v4-8 expects mesh.num_devices=4"),
        (["trainer.batch_size=12"], "trainer.batch_size=12"),
        (["trainer.steps=0"], "trainer.steps=0"),
        (["trainer.steps=-3"], "trainer.steps=-3"),
        (["trainer.microbatches=3"], "trainer.microbatches=3"),
        (
            ["trainer.grad_impl=pjit"],
            "trainer.grad_impl='pjit' is not allowed; choose one of ['manual', 'gspmd', 'auto']",
        ),
        (["trainer.grad_impl=AUTO"], "trainer.grad_impl='AUTO' is not allowed"),
        (
            ["mesh=cpu4x2", "reduction.axis_name=[data,model]"],
            "reduction.axis_name=['data', 'model'] must name the data-parallel axes",
        ),
        (["reduction.axis_name=fsdp"], "['fsdp'] not an axis of the mesh. Allowed: ['data']"),
        (["trainer.max_consecutive_nonfinite=-1"], "trainer.max_consecutive_nonfinite=-1"),
        (["checkpoint.keep=0"], "checkpoint.keep=0"),
        (
            ["paths.tb_dir=/proc/forbidden/tb"],
            "paths.tb_dir='/proc/forbidden/tb' cannot be written",
        ),
    ],
)
def test_bad_config_is_a_config_error_naming_key_and_value(compose_config, overrides, message):
    with pytest.raises(ConfigError) as err:
        train(compose_config(*overrides))
    assert message in str(err.value)


def test_resume_from_without_checkpoint_is_a_checkpoint_error(compose_config, tmp_path):
    with pytest.raises(
        CheckpointError, match="trainer.resume_from=.* holds no complete checkpoint"
    ):
        train(compose_config(f"trainer.resume_from={tmp_path / 'none'}"))


def test_target_outside_the_allowlist_is_never_imported(compose_config, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "xs_evil_target.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nclass Boom:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match="'xs_evil_target.Boom' is not an allowed target.*allowed_targets"
    ):
        train(compose_config("task._target_=xs_evil_target.Boom"))
    assert not marker.exists()
    # Allowed, it is imported (and then refused for its arguments): the allowlist is the gate.
    with pytest.raises(ConfigError, match="not an argument of xs_evil_target.Boom"):
        train(
            compose_config(
                "task._target_=xs_evil_target.Boom", "+allowed_targets=[xs_evil_target.]"
            )
        )
    assert marker.exists()
