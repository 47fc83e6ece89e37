"""`trainer.hooks`: the user's own `trainers.Hook` subclasses from config, under the allowlist."""

from __future__ import annotations

import json
import textwrap

import pytest
from hydra import compose, initialize_config_module

from tests.cli import run_train
from trainers.app.builders import build_hooks
from trainers.train import train
from xshard.config.targets import allowed_prefixes
from xshard.errors import ConfigError

HOOK_PACKAGE = textwrap.dedent(
    """
    import json
    from pathlib import Path

    from trainers import Hook


    class Recorder(Hook):
        '''Appends every step's loss to a JSON-lines file.'''

        def __init__(self, path: str, every: int = 1):
            self.path, self.every = Path(path), every

        def on_step(self, step, metrics):
            if step % self.every == 0:
                with self.path.open("a") as f:
                    f.write(json.dumps({"step": step, "loss": metrics["train/loss"]}) + "\\n")

        def on_end(self, step, state, reason):
            with self.path.open("a") as f:
                f.write(json.dumps({"end": reason, "step": step}) + "\\n")


    class NotAHook:
        pass
    """
)


@pytest.fixture
def hook_package(tmp_path, monkeypatch):
    (tmp_path / "xs_hooks.py").write_text(HOOK_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_hooks_are_built_from_config_nodes(hook_package):
    allowed = allowed_prefixes(["xs_hooks."])
    (hook,) = build_hooks([{"_target_": "xs_hooks.Recorder", "path": "x", "every": 2}], allowed)
    assert type(hook).__name__ == "Recorder" and hook.every == 2


@pytest.mark.parametrize(
    "node, message",
    [
        ({"_target_": "xs_hooks.Recorder", "path": "x"}, "is not an allowed target"),
        ({"_target_": "xs_hooks.Recorder"}, "trainer.hooks[0].path is required"),
        ({"_target_": "xs_hooks.Recorder", "path": "x", "evry": 2}, "trainer.hooks[0].evry: not"),
        ({"_target_": "xs_hooks.NotAHook"}, "built a NotAHook, not a trainers.Hook"),
    ],
)
def test_bad_hook_nodes_are_config_errors(hook_package, node, message):
    allowed = () if "allowed" in message else allowed_prefixes(["xs_hooks."])
    with pytest.raises(ConfigError) as err:
        build_hooks([node], allowed or allowed_prefixes())
    assert message in str(err.value)


def test_a_hook_node_without_target_is_refused_before_any_work(tmp_path):
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train",
            overrides=["task=mlp", f"paths.output_dir={tmp_path}", "trainer.hooks=[{every:2}]"],
        )
    with pytest.raises(ConfigError, match=r"trainer.hooks\[0\]=\{'every': 2\}: expected a node"):
        train(cfg)


@pytest.mark.slow
def test_cli_runs_the_users_hook_after_the_built_in_ones(hook_package, tmp_path):
    log = tmp_path / "steps.jsonl"
    run = tmp_path / "run"
    run_train(
        "task=mlp",
        "checkpoint=none",
        "trainer.steps=4",
        "trainer.batch_size=16",
        f"hydra.run.dir={run}",
        "+allowed_targets=[xs_hooks.]",
        f"trainer.hooks=[{{_target_:xs_hooks.Recorder,path:'{log}'}}]",
        cwd=tmp_path,
        env={"PYTHONPATH": str(hook_package)},
    )
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines[:-1]] == [1, 2, 3, 4]
    assert lines[-1] == {"end": "done", "step": 4}
