"""The ``task.data`` node: train a built-in task on the user's own file instead of its data.

    python -m trainers.train task=mlp task.data.path=my.npz task.data.keys='{x: feats, y: labels}'
    python -m trainers.train task=tiny_gpt task.data.path=my_book.txt

The built-in task options take the node's keys and defaults from this dataclass (through
their defaults lists, ``/xshard_schemas/data@data: base``); the task reads it with
`read_node`, so a bad value is one line naming ``task.data.<key>`` (exit 2). What a file must
hold (array names, shapes, dtypes) is checked by the loader (`trainers.data.files`), which
knows the task's batch keys. Imports neither JAX nor NumPy.
"""

from __future__ import annotations

import dataclasses

from trainers.config.run import check_int
from xshard.config.nodes import shown
from xshard.errors import ConfigError

#: File suffixes the loader reads: NumPy arrays, or text whose bytes are tokens.
ARRAY_SUFFIXES = (".npz", ".npy")
TEXT_SUFFIXES = (".txt",)

#: Default ``task.data.max_bytes``: 4 GiB. A ``.npz`` is unpacked into host memory, whole, by
#: every process on the host, and a few MB of zip can declare many GB (a decompression bomb);
#: 4 GiB fits the memory of any machine that trains, a few times over on a host with several
#: processes. A larger dataset belongs in a memory-mapped ``.npy`` or a `DataSource`; a
#: trusted larger ``.npz`` raises the key.
DEFAULT_MAX_BYTES = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The ``task.data`` node.

    Attributes:
      path: the examples: a ``.npz`` (named arrays, one row per example), a ``.npy`` (one
        array) or a ``.txt`` (its bytes are tokens); relative to the working directory.
        null: the task's own (synthetic or built-in) data.
      keys: batch key -> array name in a ``.npz``, e.g. ``{x: features, y: labels}``; keys
        not named are read from arrays named like the batch key. null: all of them.
      shuffle: shuffle the examples, in a new order each epoch (a pure function of the run's
        seed and the epoch, so a resumed run sees the same order).
      num_epochs: passes over the data, after which the run ends cleanly
        (``data_exhausted``); null: endless. Each epoch has ``examples // batch_size``
        steps; the remainder of an epoch is left out (a different one each shuffled epoch).
      max_bytes: the most bytes the arrays a task reads from a ``.npz`` may unpack to (their
        uncompressed size, from each array's ``.npy`` header and the zip's declared size),
        checked before anything is unpacked. A ``.npy`` or ``.txt`` is memory-mapped, not
        unpacked, so it has no such limit.
    """

    path: str | None = None
    keys: dict[str, str] | None = None
    shuffle: bool = True
    num_epochs: int | None = None
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, str) or not self.path.strip():
                raise ConfigError(
                    f"task.data.path={shown(self.path)}: expected a file path or null."
                )
            suffix = "." + self.path.rsplit(".", 1)[-1].lower() if "." in self.path else ""
            if suffix not in ARRAY_SUFFIXES + TEXT_SUFFIXES:
                raise ConfigError(
                    f"task.data.path={shown(self.path)}: unsupported file type "
                    f"{suffix or '(no suffix)'}; expected one of "
                    f"{list(ARRAY_SUFFIXES + TEXT_SUFFIXES)}."
                )
        for name, array in (self.keys or {}).items():
            if not isinstance(array, str) or not array:
                raise ConfigError(
                    f"task.data.keys.{name}={shown(array)}: expected the name of an array in "
                    "the .npz file."
                )
        if self.num_epochs is not None:
            check_int(self.num_epochs, "task.data.num_epochs", 1, ">= 1, or null (endless)")
        check_int(
            self.max_bytes, "task.data.max_bytes", 1, ">= 1 (bytes a .npz's arrays may unpack to)"
        )

    @property
    def suffix(self) -> str:
        """The path's suffix in lower case (``.npz``), or '' without a path."""
        return "" if self.path is None else "." + self.path.rsplit(".", 1)[-1].lower()
