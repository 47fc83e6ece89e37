"""The ``task.data`` node: a NumPy or text file as a built-in task's examples, no code needed.

A task states what one example is (`Field`: the shape of one row and its dtype per batch
key) and calls `file_examples` (arrays: ``.npz``/``.npy``) or `file_tokens` (a token stream:
``.txt``/``.npy``). Everything a file can get wrong is a `ConfigError` naming ``task.data.*``,
the value and what is allowed (the CLI's one line and exit 2): a missing file or one that is
not a regular file (a directory, FIFO or device is never opened), a file that is not what its
suffix says, a missing array, a ``.npz`` whose arrays would unpack to more than
``task.data.max_bytes``, a wrong shape or dtype, a value the cast would change (NaN, inf, out
of range: checked in the file's own dtype, and reported as stored), too few examples.

The file is untrusted: `trainers.data.file_io` reads it without pickle, reads only the arrays
the task uses, and checks their headers before reading any.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np

from trainers.config.data import DataOptions
from trainers.data import file_io
from trainers.data.arrays import ArrayData, TokenWindows
from trainers.rundir.user_paths import launch_dir, user_path
from xshard.config.nodes import read_node, shown
from xshard.errors import ConfigError

KEY = "task.data"
_SCAN = 1 << 20  # values per slice when scanning an array's values (`first_index`)
_INT32_END = 2**31  # token ids are cast to int32 per batch


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


def _named(options: DataOptions) -> str:
    return f"{KEY}.path={shown(options.path)}"


def _open(options: DataOptions) -> BinaryIO:
    """The file at ``task.data.path``, if it is a regular file (`file_io.open_regular`)."""
    assert options.path is not None  # `_options` returns only options with a path
    path = user_path(options.path, launch_dir())  # where the user typed it, not the run dir
    return file_io.open_regular(path, _named(options))


def _check_kind(array: np.ndarray, field: Field, what: str) -> None:
    """ConfigError unless `array`'s dtype is numbers `field.dtype` can take."""
    allowed = "biuf" if field.dtype.startswith("float") else "iu"
    if array.dtype.kind not in allowed:
        kinds = "real numbers" if allowed == "biuf" else "integers"
        raise ConfigError(f"{what} has dtype {array.dtype}; expected {kinds}.")


def _check_values(array: np.ndarray, field: Field, what: str) -> None:
    """ConfigError naming the first value, as stored, that the cast to `field.dtype` would not
    keep (up to rounding): NaN, inf or beyond the float range; beyond the integer range."""
    target = np.dtype(field.dtype)
    if target.kind == "f" and array.dtype.kind == "f":
        limit = np.finfo(target).max
        index = first_index(array, lambda chunk: ~(np.abs(chunk) <= limit))
        expected = f"expected finite numbers within {target}'s range (|x| <= {limit:.7g})"
    elif target.kind in "iu" and not np.can_cast(array.dtype, target):
        info = np.iinfo(target)
        index = first_index(array, lambda chunk: (chunk < info.min) | (chunk > info.max))
        expected = f"expected integers within {target}'s range [{info.min}, {info.max}]"
    else:
        return
    if index is not None:
        at = f"row {index[0]}" + (f" (index {index})" if len(index) > 1 else "")
        raise ConfigError(f"{what} has {array[index]} at {at}; {expected}.")


def first_index(
    array: np.ndarray, bad: Callable[[np.ndarray], np.ndarray]
) -> tuple[int, ...] | None:
    """The index of `array`'s first element (in C order) where `bad` is True, or None.

    `bad` maps a slice of rows to a boolean array of its shape; the rows are taken about
    ``_SCAN`` values at a time, so a memory-mapped array is scanned in bounded memory.
    """
    step = max(1, _SCAN // max(1, math.prod(array.shape[1:])))
    for start in range(0, len(array), step):
        mask = bad(array[start : start + step])
        if mask.any():
            index = np.unravel_index(int(np.argmax(mask)), mask.shape)
            return (start + int(index[0]), *(int(i) for i in index[1:]))
    return None


def _cast(array: np.ndarray, field: Field, what: str) -> np.ndarray:
    """`array` as `field.dtype`, after checking its kind and values in its own dtype."""
    _check_kind(array, field, what)
    _check_values(array, field, what)
    return array if array.dtype == field.dtype else array.astype(field.dtype)


def file_examples(
    node: Any, fields: Mapping[str, Field], *, task: str = "the task"
) -> ArrayData | None:
    """The examples of the ``.npz``/``.npy`` file at ``task.data.path``, as `ArrayData`.

    Batch key ``k`` is read from the array named ``task.data.keys.k`` (default ``k``); a
    ``.npy`` holds one array, for a task with one batch key. A row shape ``(1,)`` also
    accepts a 1-D array. Only those arrays are read: from a ``.npz`` at most
    ``task.data.max_bytes`` in all, checked from their headers first; a ``.npy`` is
    memory-mapped.

    Args:
      node: the ``task.data`` node (a mapping, `DataOptions` or None).
      fields: batch key -> what one example of it is.
      task: the task's name, for messages.

    Returns:
      The data, shuffled and repeated as the node says; None if the node has no path.

    Raises:
      ConfigError: for a bad node; a file that is missing, not a regular file, not a
        ``.npz``/``.npy`` or unreadable; a missing array; arrays over ``task.data.max_bytes``;
        a wrong shape or dtype; a value its dtype cannot hold (NaN, inf, out of range);
        arrays of different lengths; or no examples.
    """
    options = read_options(node)
    if options is None:
        return None
    if options.suffix not in (".npz", ".npy"):
        raise ConfigError(
            f"{_named(options)}: {task} reads arrays from a .npz (or a .npy when it has one "
            f"batch key), not {options.suffix}."
        )
    names = _array_names(options, fields, task)
    with _open(options) as file:
        stored = _read_arrays(file, options, names, task)
    arrays = {
        key: _field_array(stored[key], field, _what(options, key, names[key]), task)
        for key, field in fields.items()
    }
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ConfigError(f"{_named(options)}: the arrays differ in length (examples): {lengths}.")
    if not next(iter(lengths.values())):
        raise ConfigError(f"{_named(options)} has no examples (0 rows).")
    return ArrayData(
        arrays, shuffle=options.shuffle, num_epochs=options.num_epochs, name=_named(options)
    )


def _array_names(options: DataOptions, fields: Mapping[str, Field], task: str) -> dict[str, str]:
    """Batch key -> the name of its array in the file ('' for the one array of a ``.npy``)."""
    names = dict(options.keys or {})
    unknown = sorted(set(names) - set(fields))
    if unknown:
        raise ConfigError(
            f"{KEY}.keys.{unknown[0]}: not a batch key of {task}; its batch keys are "
            f"{sorted(fields)}."
        )
    if options.suffix == ".npy":
        return dict.fromkeys(fields, "")
    return {key: names.get(key, key) for key in fields}


def _read_arrays(
    file: BinaryIO, options: DataOptions, names: Mapping[str, str], task: str
) -> dict[str, np.ndarray]:
    """Batch key -> its array as stored: a ``.npy`` memory-mapped, or the ``.npz`` arrays
    `names` (and only those) read within ``task.data.max_bytes``."""
    if options.suffix == ".npy":
        if len(names) != 1:
            raise ConfigError(
                f"{_named(options)} holds one array, but {task} needs {sorted(names)}: save "
                "them in one .npz, e.g. np.savez(path, "
                + ", ".join(f"{k}=..." for k in names)
                + ")."
            )
        return dict.fromkeys(names, file_io.map_npy(file, _named(options)))
    npz = file_io.Npz(file, _named(options))
    for key, name in names.items():
        if name not in npz.members:
            set_key = f" (set {KEY}.keys.{key})" if key not in (options.keys or {}) else ""
            raise ConfigError(
                f"{_named(options)} has no array {name!r} for batch key {key!r}{set_key}; it "
                f"has {sorted(npz.members)}."
            )
    arrays = npz.read(names.values(), options.max_bytes)
    return {key: arrays[name] for key, name in names.items()}


def _what(options: DataOptions, key: str, name: str) -> str:
    return f"{KEY}: {key} ({options.path}{f':{name}' if name else ''})"


def _field_array(array: np.ndarray, field: Field, what: str, task: str) -> np.ndarray:
    """`array` as the rows of `field`: shape checked, values checked, cast."""
    if field.shape == (1,) and array.ndim == 1:
        array = array.reshape(-1, 1)
    if array.ndim == 0 or array.shape[1:] != field.shape:
        row = "(n, " + ", ".join(str(d) for d in field.shape) + ")"
        fix = f" ({field.hint})" if field.hint else ""
        raise ConfigError(
            f"{what} has shape {array.shape}; {task} expects {row}{fix}, one row per example."
        )
    return _cast(array, field, what)


def file_tokens(
    node: Any, *, seq_len: int, vocab_size: int, task: str = "the task"
) -> TokenWindows | None:
    """The token stream at ``task.data.path`` cut into windows of ``seq_len + 1`` tokens.

    A ``.txt`` file's bytes are the tokens; a ``.npy`` holds a 1-D array of token ids. Either
    is memory-mapped; every id is checked in the file's own dtype (so an int64 id of 2**31 or
    a uint64 one of 2**64 - 1 is reported as it is, not as what int32 makes of it) and cast to
    int32 per batch.

    Args:
      node: the ``task.data`` node (a mapping, `DataOptions` or None).
      seq_len: tokens per example (``task.seq_len``).
      vocab_size: token ids must be below it (``task.vocab_size``).
      task: the task's name, for messages.

    Returns:
      `TokenWindows` shuffled and repeated as the node says; None if the node has no path.

    Raises:
      ConfigError: for a bad node; a file that is missing, not a regular file, not a
        ``.npy`` or unreadable; a wrong shape or dtype; a token id out of range; or fewer
        than ``seq_len + 1`` tokens.
    """
    options = read_options(node)
    if options is None:
        return None
    if options.suffix not in (".txt", ".npy"):
        raise ConfigError(
            f"{_named(options)}: {task} reads a token stream: a .txt (bytes as tokens) or a "
            f"1-D .npy of token ids, not {options.suffix}."
        )
    if options.keys:
        raise ConfigError(f"{KEY}.keys={dict(options.keys)!r}: only for .npz files; use null.")
    what = _named(options)
    with _open(options) as file:
        if options.suffix == ".txt":
            tokens = file_io.map_bytes(file, what)
        else:
            tokens = file_io.map_npy(file, what)
    if tokens.ndim != 1:
        raise ConfigError(f"{what} has shape {tokens.shape}; expected a 1-D array of ids.")
    _check_kind(tokens, Field((), "int32"), what)
    if len(tokens) < seq_len + 1:
        raise ConfigError(
            f"{what} has {len(tokens)} tokens, fewer than task.seq_len + 1 = {seq_len + 1}."
        )
    _check_ids(tokens, vocab_size, what)
    return TokenWindows(
        tokens, seq_len, shuffle=options.shuffle, num_epochs=options.num_epochs, name=what
    )


def _check_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """ConfigError naming the first id outside ``[0, vocab_size)``, compared in the stored
    dtype (no cast before the check); ids above int32 are refused too (the batches are
    int32)."""
    limit = min(vocab_size, _INT32_END)
    index = first_index(tokens, lambda chunk: (chunk < 0) | (chunk >= limit))
    if index is None:
        return
    allowed = f"task.vocab_size={vocab_size}" if limit == vocab_size else "2**31 (int32 ids)"
    raise ConfigError(
        f"{what}: token {tokens[index]} at offset {index[0]} is outside [0, {allowed}); "
        "raise task.vocab_size (256 for any bytes)."
    )
