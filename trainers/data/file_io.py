"""Reading the ``task.data`` file without trusting it (a file copied from elsewhere can be
anything): nothing here blocks, unpickles, or unpacks more than the task reads.

- `open_regular`: `os.stat` first, so a directory, FIFO, device or socket is named as such and
  never opened; then ``open(O_NONBLOCK)`` and `os.fstat` on the descriptor (the path may have
  changed in between), so even a FIFO swapped in cannot block the run.
- `map_npy`, `map_bytes`: a ``.npy``/``.txt`` memory-mapped, after checking the magic string,
  the header (shape and dtype; no Python objects) and that the file holds the bytes it
  declares.
- `Npz`: a ``.npz`` (a zip of ``.npy`` members) lists its arrays and reads only those asked
  for, after checking each one's header, and the zip's declared size, against a byte budget
  (``task.data.max_bytes``): a decompression bomb is an error before any memory is spent.

Every problem is a `ConfigError` that starts with `what` (``task.data.path='my.npz'``) and says
what is wrong and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import mmap
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, BinaryIO

import numpy as np

from xshard.errors import ConfigError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first entry; an empty zip
#: The longest ``.npy`` header read: numpy's own limit (``np.load(max_header_size=)``).
MAX_HEADER_BYTES = 10_000
_CHUNK = 1 << 20  # bytes per read from a zip member
_HEADER_LENGTHS = {(1, 0): "<H", (2, 0): "<I"}  # the formats np.save writes
# The zip methods np.savez writes. zipfile caps what a deflated read unpacks; a bzip2 or LZMA
# read unpacks a whole chunk first, however much that is.
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# What reading a broken zip raises: a bad entry, a bad deflate stream, an unknown compression
# method, an encrypted entry (RuntimeError), a short file.
_ZIP_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


def open_regular(path: Path, what: str) -> BinaryIO:
    """`path` opened for reading in binary, if it is a regular file (or a link to one).

    Raises:
      ConfigError: it does not exist, cannot be opened, or is a directory, FIFO, device or
        socket (never opened, so never blocks).
    """
    try:
        _check_regular(os.stat(path).st_mode, what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"{what}: no such file{where}.") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot be opened: {e.strerror or e}.") from None
    file = os.fdopen(fd, "rb")
    try:
        _check_regular(os.fstat(fd).st_mode, what)
        os.set_blocking(fd, True)
    except BaseException:
        file.close()
        raise
    return file


def _check_regular(mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a special file")
        raise ConfigError(f"{what} is {kind}, not a regular file; expected a data file.")


@dataclasses.dataclass(frozen=True)
class NpyHeader:
    """What a ``.npy`` header declares.

    Attributes:
      shape: the array's shape.
      dtype: its dtype (never one holding Python objects).
      fortran_order: whether the data is in Fortran (column-major) order.
      size: bytes from the start of the ``.npy`` to its data (magic and header).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    size: int

    @property
    def nbytes(self) -> int:
        """Bytes of data the header declares (a Python int: no overflow)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """``shape (3, 4) of float64 (96 bytes)``, for messages."""
        return f"shape {self.shape} of {self.dtype} ({_size(self.nbytes)})"


def read_header(fp: IO[bytes], what: str) -> NpyHeader:
    """The header of the ``.npy`` at `fp`'s position, leaving `fp` at the data.

    Reads at most ``12 + MAX_HEADER_BYTES`` bytes, whatever the file claims.

    Raises:
      ConfigError: no ``.npy`` magic string, a format version np.save does not write, a
        header too long or unreadable, a negative dimension, or a dtype holding Python
        objects (only pickle could load it) or of zero bytes.
    """
    magic = fp.read(len(NPY_MAGIC) + 2)
    if len(magic) < len(NPY_MAGIC) + 2 or not magic.startswith(NPY_MAGIC):
        raise ConfigError(
            f"{what}: not a .npy array: {_starts(magic)}, not the .npy magic string "
            f"{NPY_MAGIC!r}; expected a file written by np.save."
        )
    version = (magic[-2], magic[-1])
    if version not in _HEADER_LENGTHS:
        raise ConfigError(
            f"{what}: .npy format version {version[0]}.{version[1]} is not supported; "
            "expected 1.0 or 2.0 (what np.save writes for numbers)."
        )
    raw = _header_bytes(fp, _HEADER_LENGTHS[version], what)
    reader = np.lib.format.read_array_header_1_0
    if version == (2, 0):
        reader = np.lib.format.read_array_header_2_0
    try:
        shape, fortran_order, dtype = reader(io.BytesIO(raw), max_header_size=MAX_HEADER_BYTES)
    except ValueError as e:
        raise ConfigError(f"{what}: bad .npy header: {_reason(e)}.") from None
    _check_header(shape, dtype, what)
    return NpyHeader(tuple(shape), dtype, fortran_order, len(magic) + len(raw))


def _header_bytes(fp: IO[bytes], length_format: str, what: str) -> bytes:
    """The header's length field and text, checked to be whole and not over the limit."""
    raw = fp.read(struct.calcsize(length_format))
    if len(raw) < struct.calcsize(length_format):
        raise ConfigError(f"{what}: truncated in its .npy header.")
    (length,) = struct.unpack(length_format, raw)
    if length > MAX_HEADER_BYTES:
        raise ConfigError(
            f"{what}: its .npy header claims {length} bytes, over the {MAX_HEADER_BYTES} "
            "numpy reads safely; not a file np.save wrote."
        )
    text = fp.read(length)
    if len(text) < length:
        raise ConfigError(f"{what}: truncated in its .npy header.")
    return raw + text


def _check_header(shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    if any(d < 0 for d in shape):
        raise ConfigError(f"{what}: bad .npy header: negative dimension in shape {shape}.")
    if dtype.hasobject:
        raise ConfigError(
            f"{what} holds Python objects (dtype {dtype}), which only pickle can load; "
            "not allowed: expected an array of numbers."
        )
    if dtype.itemsize == 0:
        raise ConfigError(f"{what} has dtype {dtype} of 0 bytes; expected an array of numbers.")


def map_npy(file: BinaryIO, what: str) -> np.ndarray:
    """The ``.npy`` array in `file`, memory-mapped read-only (nothing is read yet).

    Raises:
      ConfigError: a bad header (`read_header`), or fewer bytes of data than it declares.
    """
    header = read_header(file, what)
    held = os.fstat(file.fileno()).st_size - header.size
    if held < header.nbytes:
        raise ConfigError(
            f"{what} is truncated: its .npy header declares {header.describe()}, but the file "
            f"holds {_size(held)} after the header."
        )
    if not header.nbytes:
        return np.empty(header.shape, header.dtype)
    flat = np.frombuffer(_map(file, what), header.dtype, math.prod(header.shape), header.size)
    return _shaped(flat, header)


def map_bytes(file: BinaryIO, what: str) -> np.ndarray:
    """`file`'s bytes as a uint8 array, memory-mapped read-only."""
    if not os.fstat(file.fileno()).st_size:
        return np.empty(0, np.uint8)
    return np.frombuffer(_map(file, what), np.uint8)


def _map(file: BinaryIO, what: str) -> mmap.mmap:
    try:
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: cannot be memory-mapped: {_reason(e)}.") from None


def _shaped(flat: np.ndarray, header: NpyHeader) -> np.ndarray:
    if header.fortran_order:
        return flat.reshape(header.shape[::-1]).transpose()
    return flat.reshape(header.shape)


class Npz:
    """The arrays of a ``.npz`` file (a zip of ``.npy`` members), read only when asked for.

    Args:
      file: the open file, at its start; it stays open while this is used.
      what: the start of every message, e.g. ``task.data.path='my.npz'``.

    Raises:
      ConfigError: the file is not a zip archive, or its directory is unreadable.
    """

    def __init__(self, file: BinaryIO, what: str):
        head = file.read(8)
        file.seek(0)
        if head[:4] not in ZIP_MAGICS:
            raise ConfigError(
                f"{what}: not a .npz file: {_starts(head)}, not the zip magic string "
                f"{ZIP_MAGICS[0]!r}; expected a file written by np.savez."
            )
        with _reading(f"{what}: not a valid .npz (zip) file"):
            self._zip = zipfile.ZipFile(file)
        self.what = what
        self.members = {
            info.filename[: -len(".npy")]: info
            for info in self._zip.infolist()
            if info.filename.endswith(".npy") and not info.is_dir()
        }

    def read(self, names: Iterable[str], max_bytes: int) -> dict[str, np.ndarray]:
        """The arrays `names` (all in `members`), if together they unpack to <= `max_bytes`.

        Every header is checked before any array is read, and an array's data is read into
        memory of the size its header declares, in chunks: no more is ever allocated.

        Raises:
          ConfigError: a bad header, a header that disagrees with the zip's declared size,
            more than `max_bytes` in all, or a broken zip entry.
        """
        headers = self._check(dict.fromkeys(names), max_bytes)
        return {name: self._read(name, header) for name, header in headers.items()}

    def _check(self, names: Iterable[str], max_bytes: int) -> dict[str, NpyHeader]:
        headers, total = {}, 0
        for name in names:
            header = headers[name] = self._header(name)
            total += header.nbytes
            if total > max_bytes:
                before = f" ({_size(total)} with the arrays before it)" if len(headers) > 1 else ""
                raise ConfigError(
                    f"{self.what}: array {name!r} declares {header.describe()}{before}, over "
                    f"the task.data.max_bytes={max_bytes} ({_size(max_bytes)}) that the arrays "
                    "of a .npz may unpack to; raise task.data.max_bytes if you trust this file."
                )
        return headers

    def _header(self, name: str) -> NpyHeader:
        info, what = self.members[name], f"{self.what}: array {name!r}"
        if info.compress_type not in _METHODS:
            raise ConfigError(
                f"{what} is compressed with zip method {info.compress_type}; expected "
                f"{' or '.join(_METHODS.values())} (what np.savez writes)."
            )
        with _reading(f"{what} cannot be read"), self._zip.open(info) as fp:
            header = read_header(fp, what)
        if header.size + header.nbytes != info.file_size:
            raise ConfigError(
                f"{what} is corrupt: its .npy header declares {header.describe()}, but the "
                f"zip entry declares {_size(info.file_size - header.size)} of data."
            )
        return header

    def _read(self, name: str, header: NpyHeader) -> np.ndarray:
        what = f"{self.what}: array {name!r}"
        flat = np.empty(math.prod(header.shape), header.dtype)
        with _reading(f"{what} cannot be read"), self._zip.open(self.members[name]) as fp:
            fp.read(header.size)  # checked by _header; the zip stops at its declared size
            _fill(fp, flat.view(np.uint8), what)
        return _shaped(flat, header)


def _fill(fp: IO[bytes], out: np.ndarray, what: str) -> None:
    """Reads ``len(out)`` bytes from `fp` into the uint8 array `out`, `_CHUNK` at a time."""
    done = 0
    while done < len(out):
        chunk = fp.read(min(_CHUNK, len(out) - done))
        if not chunk:
            raise ConfigError(f"{what} is truncated: {done} of {len(out)} bytes of data.")
        out[done : done + len(chunk)] = np.frombuffer(chunk, np.uint8)
        done += len(chunk)


@contextlib.contextmanager
def _reading(prefix: str) -> Iterator[None]:
    """Turns what reading a broken zip raises into ``ConfigError(f"{prefix}: {reason}.")``."""
    try:
        yield
    except ConfigError:
        raise
    except _ZIP_ERRORS as e:
        raise ConfigError(f"{prefix}: {_reason(e)}.") from None


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0].rstrip(".") if text else type(e).__name__


def _starts(head: bytes) -> str:
    return f"it starts with {head!r}" if head else "it is empty"


def _size(n: int) -> str:
    """``96 bytes``, ``1.5 MiB``, ``2.0 GiB``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        if value < 1024 or unit == "EiB":
            return f"{value:.4g} {unit}"
    raise AssertionError("unreachable")
