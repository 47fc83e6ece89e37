"""``task.data``: the built-in tasks train on the user's own .npz/.npy/.txt file, and every bad
file or value is one `ConfigError` naming the key (in-process here; through the real CLI, exit
2 and one line, in tests/trainers/data/test_data_cli.py)."""

from __future__ import annotations

import os
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from trainers.data import file_io
from trainers.data.files import Field, file_examples
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
    write_untrusted_files(folder, x)
    return folder


def write_untrusted_files(folder: Path, x: np.ndarray) -> None:
    """Files an attacker (or bad luck) hands over: a forged bomb, ids int32 cannot hold,
    values float32 cannot hold, random bytes, pickled objects, things that are not files."""
    forge_npz(folder / "forged.npz", (2**33, 16), y=x[:, :4])  # 1 TiB declared, 0.3 KB file
    forge_npz(folder / "lying.npz", (2**33, 16), y=x[:, :4], zip_agrees=False)
    ids = np.arange(2000) % 50
    ids[7] = 2**32 + 5  # int32 makes it 5: in range, silently trained on
    np.save(folder / "ids_wide.npy", ids)
    ids = ids.astype(np.uint64)
    ids[3] = 2**64 - 1  # int32 makes it -1
    np.save(folder / "ids_u64.npy", ids)
    huge = x.copy()
    huge[3, 5] = 1e300  # float32 makes it inf
    np.savez(folder / "huge.npz", x=huge, y=x[:, :4])
    huge[3, 5] = np.nan
    np.savez(folder / "nan.npz", x=huge, y=x[:, :4])
    rng = np.random.default_rng(1)
    (folder / "random.npz").write_bytes(b"\x89\xfd" + rng.bytes(4094))
    (folder / "random.npy").write_bytes(b"\x89\xfd" + rng.bytes(4094))
    np.save(folder / "objects.npy", np.array([{"x": 1}] * 40, dtype=object), allow_pickle=True)
    (folder / "cut.npy").write_bytes((folder / "ids.npy").read_bytes()[:1000])
    (folder / "folder.npz").mkdir()
    os.mkfifo(folder / "pipe.npz")
    os.mkfifo(folder / "pipe.txt")
    (folder / "zero.npy").symlink_to("/dev/zero")


def forge_npz(path: Path, shape: tuple[int, ...], *, zip_agrees: bool = True, **arrays) -> None:
    """A .npz whose member x.npy declares `shape` of float64 but holds 64 bytes of data.

    Its zip directory declares the same size as the header unless `zip_agrees` is False;
    either way the file stays a few hundred bytes.
    """
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            header = {"descr": "<f8", "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(f, header)
            f.write(bytes(64))
        if zip_agrees:  # the central directory is written on close, from the ZipInfo
            zf.getinfo("x.npy").file_size += int(np.prod(shape)) * 8 - 64
        for name, array in arrays.items():
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array)


def write_bomb(path: Path, member: str, nbytes: int, **arrays) -> None:
    """A real decompression bomb: member `member` holds `nbytes` of float64 zeros, deflated
    (about 1000:1), streamed so writing it needs no such memory; plus `arrays`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open(f"{member}.npy", "w", force_zip64=True) as f:
            header = {"descr": "<f8", "fortran_order": False, "shape": (nbytes // 8 // 16, 16)}
            np.lib.format.write_array_header_1_0(f, header)
            zeros = bytes(1 << 22)
            for _ in range(nbytes // len(zeros)):
                f.write(zeros)
        for name, array in arrays.items():
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array)


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
        (["task.data.path=broken.npz"], "broken.npz': not a .npz file: it starts with b'not a zi'"),
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
        # Untrusted files (write_untrusted_files): each with its own reason.
        (
            ["task.data.path=forged.npz"],
            (
                "forged.npz': array 'x' declares shape (8589934592, 16) of float64 (1 TiB), "
                "over the task.data.max_bytes=4294967296 (4 GiB)"
            ),
        ),
        (
            ["task.data.path=good.npz", "task.data.max_bytes=6000"],
            (
                "array 'y' declares shape (40, 4) of float64 (1.25 KiB) (6.25 KiB with the "
                "arrays before it), over the task.data.max_bytes=6000 (5.859 KiB)"
            ),
        ),
        (["task.data.path=good.npz", "task.data.max_bytes=0"], "task.data.max_bytes=0: expected"),
        (
            ["task.data.path=lying.npz"],
            "array 'x' is corrupt: its .npy header declares shape (8589934592, 16) of float64",
        ),
        (
            ["task=tiny_gpt", "task.data.path=ids_wide.npy"],
            "token 4294967301 at offset 7 is outside [0, task.vocab_size=128)",
        ),
        (
            ["task=tiny_gpt", "task.data.path=ids_u64.npy"],
            "token 18446744073709551615 at offset 3 is outside [0, task.vocab_size=128)",
        ),
        (
            ["task.data.path=huge.npz"],
            (
                "x ({f}/huge.npz:x) has 1e+300 at row 3 (index (3, 5)); expected finite "
                "numbers within float32's range"
            ),
        ),
        (["task.data.path=nan.npz"], "x ({f}/nan.npz:x) has nan at row 3 (index (3, 5))"),
        (
            ["task.data.path=random.npz"],
            "random.npz': not a .npz file: it starts with b'\\x89\\xfd",
        ),
        (
            ["task=tiny_gpt", "task.data.path=random.npy"],
            "random.npy': not a .npy array: it starts with b'\\x89\\xfd",
        ),
        (
            ["task=tiny_gpt", "task.data.path=objects.npy"],
            "objects.npy' holds Python objects (dtype object), which only pickle can load",
        ),
        (
            ["task=tiny_gpt", "task.data.path=cut.npy"],
            "cut.npy' is truncated: its .npy header declares shape (2000,) of int64",
        ),
        (["task.data.path=folder.npz"], "folder.npz' is a directory, not a regular file"),
        (["task.data.path=pipe.npz"], "pipe.npz' is a FIFO (named pipe), not a regular file"),
        (["task=tiny_gpt", "task.data.path=pipe.txt"], "pipe.txt' is a FIFO (named pipe)"),
        (["task=tiny_gpt", "task.data.path=zero.npy"], "zero.npy' is a character device"),
    ],
)
@pytest.mark.timeout(60)  # a FIFO opened for reading would block: fail, never hang
def test_bad_data_is_a_config_error_naming_the_key(compose_config, files, overrides, message):
    absolute = [
        o.replace("path=", f"path={files}/") if o.startswith("task.data.path=") else o
        for o in overrides
    ]
    with pytest.raises(ConfigError) as err:
        train(compose_config(*absolute, "checkpoint=none", "trainer.steps=2"))
    assert message.replace("{f}", str(files)) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> Path:
    """bomb.npz: x is 128 MiB of zeros in a 0.13 MB file; extra.npz: good x and y, and an
    unused member of 128 MiB of zeros."""
    folder = tmp_path_factory.mktemp("bombs")
    x = np.random.default_rng(0).standard_normal((40, 16))
    write_bomb(folder / "bomb.npz", "x", 2**27, y=x[:, :4])
    write_bomb(folder / "extra.npz", "junk", 2**27, x=x, y=x[:, :4])
    assert (folder / "bomb.npz").stat().st_size < 2**27 // 500
    return folder


def _peak_bytes(fn, *args, **kwargs) -> int:
    """The most memory Python and NumPy held at once while `fn` ran (tracemalloc sees every
    NumPy array's data)."""
    tracemalloc.start()
    try:
        fn(*args, **kwargs)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


FIELDS = {"x": Field((16,)), "y": Field((4,))}


def test_a_decompression_bomb_is_refused_before_it_is_unpacked(bombs):
    node = {"path": str(bombs / "bomb.npz"), "max_bytes": 2**26}

    def load():
        with pytest.raises(ConfigError) as err:
            file_examples(node, FIELDS, task="task=mlp")
        assert "array 'x' declares shape (1048576, 16) of float64 (128 MiB)" in str(err.value)
        assert "over the task.data.max_bytes=67108864 (64 MiB)" in str(err.value)

    assert _peak_bytes(load) < 2**22  # nothing near the 128 MiB (or the budget) was allocated


def test_an_unused_member_is_never_unpacked(bombs):
    """The budget counts the arrays the task reads: x and y, 6400 bytes, not `junk`."""
    node = {"path": str(bombs / "extra.npz"), "shuffle": False, "max_bytes": 6400}
    peak = _peak_bytes(file_examples, node, FIELDS, task="task=mlp")
    assert peak < 2**22  # the 128 MiB member `junk` was not read
    data = file_examples(node, FIELDS, task="task=mlp")
    with np.load(bombs / "extra.npz") as stored:
        np.testing.assert_array_equal(data.arrays["x"], stored["x"].astype(np.float32))


@pytest.mark.parametrize("fortran", [False, True])
@pytest.mark.parametrize("dtype", ["<f8", ">f8", ">i4", "<u2", "|u1"])
def test_arrays_read_as_numpy_reads_them(tmp_path, fortran, dtype):
    """The checked reader gives what np.load gives, for any byte order and memory order."""
    array = (np.arange(60).reshape(5, 12) * 3).astype(dtype)
    array = np.asfortranarray(array) if fortran else array
    np.save(tmp_path / "a.npy", array)
    np.savez_compressed(tmp_path / "a.npz", a=array, b=array[:2])
    with open(tmp_path / "a.npy", "rb") as f:
        mapped = file_io.map_npy(f, "a.npy")
    with open(tmp_path / "a.npz", "rb") as f:
        read = file_io.Npz(f, "a.npz").read(["a"], max_bytes=array.nbytes)["a"]
    for got in (mapped, read):
        np.testing.assert_array_equal(got, array)
        assert got.dtype == array.dtype and got.flags.f_contiguous == fortran


def test_a_bad_zip_entry_names_its_array(tmp_path):
    """A bit flipped in a deflated member: the zip's CRC check is a one-line error."""
    x = np.arange(4000.0).reshape(250, 16)
    np.savez_compressed(tmp_path / "bad.npz", x=x, y=x[:, :4])
    raw = bytearray((tmp_path / "bad.npz").read_bytes())
    raw[len(raw) // 4] ^= 0xFF
    (tmp_path / "bad.npz").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"bad\.npz': array 'x' cannot be read: "):
        file_examples({"path": str(tmp_path / "bad.npz")}, FIELDS)
