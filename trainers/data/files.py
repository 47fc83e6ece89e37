"""The ``task.data`` node: a NumPy or text file as a built-in task's examples, no code needed.

A task states what one example is (`Field`: the shape of one row and its dtype per batch
key) and calls `file_examples` (arrays: ``.npz``/``.npy``) or `file_tokens` (a token stream:
``.txt``/``.npy``). Everything a file can get wrong is a `ConfigError` naming ``task.data.*``,
the value and what is allowed: a missing or unreadable file, a missing array, a wrong shape
or dtype, too few examples (the CLI's one line and exit 2).
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainers.data.arrays import ArrayData, TokenWindows
from xshard.config.data import DataOptions
from xshard.config.nodes import read_node
from xshard.errors import ConfigError

KEY = "task.data"


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch key of a task's examples.

    Attributes:
      shape: the shape of one example (one row), e.g. ``(16,)``.
      dtype: what the rows are cast to: ``"float32"`` (from any real numbers) or ``"int32"``
        (from integers).
      hint: the task keys that set `shape`, for error messages (``task.in_dim=16``).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    hint: str = ""


def read_options(node: Any) -> DataOptions | None:
    """The ``task.data`` node as `DataOptions`, or None when it is null or has no path.

    Raises:
      ConfigError: for an unknown key or a bad value.
    """
    if node is None or isinstance(node, DataOptions):
        options = node
    else:
        options = read_node(DataOptions, node, KEY)
    return options if options is not None and options.path is not None else None


def _path(options: DataOptions) -> Path:
    path = Path(options.path).expanduser()
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"{KEY}.path={options.path!r}: no such file{where}.")
    return path


def _load(options: DataOptions) -> dict[str, np.ndarray]:
    """The file's arrays by name (a ``.npy`` holds one, named ''); memory-mapped if ``.npy``."""
    path = _path(options)
    try:
        if options.suffix == ".npy":
            return {"": np.load(path, mmap_mode="r", allow_pickle=False)}
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"{KEY}.path={options.path!r} cannot be read as {options.suffix}: {reason}"
        ) from e


def _cast(array: np.ndarray, field: Field, what: str) -> np.ndarray:
    """`array` as `field.dtype`, if its kind allows that exactly enough; else ConfigError."""
    allowed = "biuf" if field.dtype.startswith("float") else "iu"
    if array.dtype.kind not in allowed:
        kinds = "real numbers" if allowed == "biuf" else "integers"
        raise ConfigError(f"{what} has dtype {array.dtype}; expected {kinds}.")
    return array if array.dtype == field.dtype else array.astype(field.dtype)


def file_examples(
    node: Any, fields: Mapping[str, Field], *, task: str = "the task"
) -> ArrayData | None:
    """The examples of the ``.npz``/``.npy`` file at ``task.data.path``, as `ArrayData`.

    Batch key ``k`` is read from the array named ``task.data.keys.k`` (default ``k``); a
    ``.npy`` holds one array, for a task with one batch key. A row shape ``(1,)`` also
    accepts a 1-D array.

    Args:
      node: the ``task.data`` node (a mapping, `DataOptions` or None).
      fields: batch key -> what one example of it is.
      task: the task's name, for messages.

    Returns:
      The data, shuffled and repeated as the node says; None if the node has no path.

    Raises:
      ConfigError: for a bad node, a missing or unreadable file, a missing array, a wrong
        shape or dtype, arrays of different lengths, or no examples.
    """
    options = read_options(node)
    if options is None:
        return None
    if options.suffix not in (".npz", ".npy"):
        raise ConfigError(
            f"{KEY}.path={options.path!r}: {task} reads arrays from a .npz (or a .npy when it "
            f"has one batch key), not {options.suffix}."
        )
    names = dict(options.keys or {})
    unknown = sorted(set(names) - set(fields))
    if unknown:
        raise ConfigError(
            f"{KEY}.keys.{unknown[0]}: not a batch key of {task}; its batch keys are "
            f"{sorted(fields)}."
        )
    stored = _load(options)
    if options.suffix == ".npy" and len(fields) != 1:
        raise ConfigError(
            f"{KEY}.path={options.path!r} holds one array, but {task} needs "
            f"{sorted(fields)}: save them in one .npz, e.g. np.savez(path, "
            + ", ".join(f"{k}=..." for k in fields)
            + ")."
        )
    arrays = {}
    for key, field in fields.items():
        name = "" if options.suffix == ".npy" else names.get(key, key)
        if name not in stored:
            set_key = f" (set {KEY}.keys.{key})" if key not in names else ""
            raise ConfigError(
                f"{KEY}.path={options.path!r} has no array {name!r} for batch key "
                f"{key!r}{set_key}; it has {sorted(stored)}."
            )
        what = f"{KEY}: {key} ({options.path}{f':{name}' if name else ''})"
        array = stored[name]
        if field.shape == (1,) and array.ndim == 1:
            array = array.reshape(-1, 1)
        if array.ndim == 0 or array.shape[1:] != field.shape:
            row = "(n, " + ", ".join(str(d) for d in field.shape) + ")"
            fix = f" ({field.hint})" if field.hint else ""
            raise ConfigError(
                f"{what} has shape {array.shape}; {task} expects {row}{fix}, one row per example."
            )
        arrays[key] = _cast(array, field, what)
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ConfigError(
            f"{KEY}.path={options.path!r}: the arrays differ in length (examples): {lengths}."
        )
    if not next(iter(lengths.values())):
        raise ConfigError(f"{KEY}.path={options.path!r} has no examples (0 rows).")
    return ArrayData(
        arrays,
        shuffle=options.shuffle,
        num_epochs=options.num_epochs,
        name=f"{KEY}.path={options.path!r}",
    )


def file_tokens(
    node: Any, *, seq_len: int, vocab_size: int, task: str = "the task"
) -> TokenWindows | None:
    """The token stream at ``task.data.path`` cut into windows of ``seq_len + 1`` tokens.

    A ``.txt`` file's bytes are the tokens; a ``.npy`` holds a 1-D array of token ids.

    Args:
      node: the ``task.data`` node (a mapping, `DataOptions` or None).
      seq_len: tokens per example (``task.seq_len``).
      vocab_size: token ids must be below it (``task.vocab_size``).
      task: the task's name, for messages.

    Returns:
      `TokenWindows` shuffled and repeated as the node says; None if the node has no path.

    Raises:
      ConfigError: for a bad node, a missing or unreadable file, a wrong shape or dtype, a
        token id out of range, or fewer than ``seq_len + 1`` tokens.
    """
    options = read_options(node)
    if options is None:
        return None
    if options.suffix not in (".txt", ".npy"):
        raise ConfigError(
            f"{KEY}.path={options.path!r}: {task} reads a token stream: a .txt (bytes as "
            f"tokens) or a 1-D .npy of token ids, not {options.suffix}."
        )
    if options.keys:
        raise ConfigError(f"{KEY}.keys={dict(options.keys)!r}: only for .npz files; use null.")
    what = f"{KEY}.path={options.path!r}"
    if options.suffix == ".txt":
        tokens = np.frombuffer(_path(options).read_bytes(), dtype=np.uint8)
    else:
        tokens = _load(options)[""]
        if tokens.ndim != 1:
            raise ConfigError(f"{what} has shape {tokens.shape}; expected a 1-D array of ids.")
        tokens = _cast(tokens, Field((), "int32"), what)
    if len(tokens) < seq_len + 1:
        raise ConfigError(
            f"{what} has {len(tokens)} tokens, fewer than task.seq_len + 1 = {seq_len + 1}."
        )
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        raise ConfigError(
            f"{what}: token {int(tokens[bad[0]])} at offset {int(bad[0])} is outside "
            f"[0, task.vocab_size={vocab_size}); raise task.vocab_size (256 for any bytes)."
        )
    return TokenWindows(
        tokens,
        seq_len,
        shuffle=options.shuffle,
        num_epochs=options.num_epochs,
        name=what,
    )
