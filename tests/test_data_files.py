"""``task.data``: the built-in tasks train on the user's own .npz/.npy/.txt file, and every bad
file or value is one `ConfigError` naming the key (in-process here; through the real CLI, exit
2 and one line, in tests/test_data_cli.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainers.tasks.mlp import MLPTask
from trainers.tasks.tiny_gpt import TinyGPTTask
from trainers.train import train
from xshard.errors import ConfigError


def write_files(folder: Path) -> Path:
    """The good and bad files the tests use, in `folder`; returns `folder`."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 16))
    np.savez(folder / "good.npz", x=x, y=x[:, :4] ** 2)
    np.savez(folder / "named.npz", features=x.astype(np.float16), labels=x[:, :4])
    np.savez(folder / "narrow.npz", x=x[:, :8], y=x[:, :4])
    np.savez(folder / "strings.npz", x=np.array([["a"] * 16] * 40), y=x[:, :4])
    np.savez(folder / "ragged.npz", x=x, y=x[:30, :4])
    np.savez(folder / "few.npz", x=x[:5], y=x[:5, :4])
    np.save(folder / "one.npy", x)
    (folder / "broken.npz").write_bytes(b"not a zip file")
    (folder / "ascii.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (folder / "latin.txt").write_bytes("café ".encode() * 100)
    np.save(folder / "ids.npy", np.arange(2000) % 50)
    return folder


@pytest.fixture
def files(tmp_path) -> Path:
    return write_files(tmp_path)


def test_mlp_reads_x_and_y_from_a_npz(files):
    task = MLPTask(data={"path": str(files / "good.npz"), "shuffle": False})
    batch = next(task.batches(8, seed=0))
    stored = np.load(files / "good.npz")
    np.testing.assert_array_equal(batch["x"], stored["x"][:8].astype(np.float32))
    np.testing.assert_array_equal(batch["y"], stored["y"][:8].astype(np.float32))
    assert batch["x"].dtype == batch["y"].dtype == np.float32
    assert task.num_data_steps(8) is None  # endless unless num_epochs
    assert MLPTask(data={"path": str(files / "good.npz"), "num_epochs": 2}).num_data_steps(8) == 10


def test_mlp_reads_renamed_arrays(files):
    task = MLPTask(
        data={"path": str(files / "named.npz"), "keys": {"x": "features", "y": "labels"}}
    )
    batch = next(task.batches(8, seed=0))
    assert batch["x"].shape == (8, 16) and batch["x"].dtype == np.float32


def test_without_a_path_the_task_keeps_its_own_data():
    ours = MLPTask(data={"path": None})
    assert ours.data is None
    np.testing.assert_array_equal(
        next(ours.batches(8, seed=1))["x"], next(MLPTask().batches(8, seed=1))["x"]
    )


def test_tiny_gpt_reads_text_and_token_ids(files):
    text = TinyGPTTask(seq_len=16, data={"path": str(files / "ascii.txt"), "shuffle": False})
    batch = next(text.batches(4, seed=0))
    raw = np.frombuffer((files / "ascii.txt").read_bytes(), np.uint8)
    np.testing.assert_array_equal(batch["inputs"][1], raw[16:32])
    np.testing.assert_array_equal(batch["targets"][1], raw[17:33])
    ids = TinyGPTTask(vocab_size=50, seq_len=16, data={"path": str(files / "ids.npy")})
    assert next(ids.batches(4, seed=0))["inputs"].max() < 50


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.data.path=missing.npz"], "task.data.path='{f}/missing.npz': no such file"),
        (
            ["task.data.path=good.npz", "task.data.keys={x: feats}"],
            "has no array 'feats' for batch key 'x'; it has ['x', 'y']",
        ),
        (["task.data.path=named.npz"], "has no array 'x' for batch key 'x' (set task.data.keys.x)"),
        (["task.data.path=good.npz", "task.data.keys={z: x}"], "task.data.keys.z: not a batch key"),
        (
            ["task.data.path=narrow.npz"],
            (
                "task.data: x ({f}/narrow.npz:x) has shape (40, 8); task=mlp expects (n, 16) "
                "(task.in_dim=16)"
            ),
        ),
        (["task.data.path=strings.npz"], "has dtype <U1; expected real numbers"),
        (
            ["task.data.path=ragged.npz"],
            "the arrays differ in length (examples): {'x': 40, 'y': 30}",
        ),
        (["task.data.path=one.npy"], "holds one array, but task=mlp needs ['x', 'y']"),
        (["task.data.path=broken.npz"], "cannot be read as .npz"),
        (["task.data.path=ascii.txt"], "task=mlp reads arrays from a .npz"),
        (["task.data.path=table.csv"], "unsupported file type .csv; expected one of"),
        (["task.data.path=good.npz", "task.data.shuffle=maybe"], "task.data.shuffle='maybe'"),
        (["task.data.path=good.npz", "task.data.num_epochs=0"], "task.data.num_epochs=0"),
        (
            ["task.data.path=few.npz"],
            "task.data.path='{f}/few.npz' has 5 examples, fewer than one global batch of 16",
        ),
        (
            ["task.data.path=good.npz", "task.num_examples=10"],
            "with task.data.path set them to null",
        ),
        (
            ["task=tiny_gpt", "task.data.path=latin.txt"],
            "token 195 at offset 3 is outside [0, task.vocab_size=128)",
        ),
        (["task=tiny_gpt", "task.data.path=good.npz"], "task=tiny_gpt reads a token stream"),
        (["task=tiny_gpt", "task.data.path=one.npy"], "has shape (40, 16); expected a 1-D array"),
        (
            ["task=tiny_gpt", "task.seq_len=4096", "task.data.path=ascii.txt"],
            "has 1800 tokens, fewer than task.seq_len + 1 = 4097",
        ),
    ],
)
def test_bad_data_is_a_config_error_naming_the_key(compose_config, files, overrides, message):
    absolute = [
        o.replace("path=", f"path={files}/") if o.startswith("task.data.path=") else o
        for o in overrides
    ]
    with pytest.raises(ConfigError) as err:
        train(compose_config(*absolute, "checkpoint=none", "trainer.steps=2"))
    assert message.replace("{f}", str(files)) in str(err.value)
    assert "\n" not in str(err.value)
