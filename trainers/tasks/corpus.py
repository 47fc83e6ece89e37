"""An offline text corpus: the docstrings of a fixed list of Python standard-library modules.

Nothing is downloaded and nothing is shipped: the text is gathered at run time from the
interpreter's own standard library, so it is available on any machine, and it is identical on
every run for a given Python version (the modules, and the members within them, are visited in a
fixed order). The text is normalised to 7-bit ASCII, so byte values are tokens in [0, 128).

It is gathered in a fresh interpreter (``python -I`` running this file): packages imported
before it would otherwise change it, as they patch standard-library modules (PyTorch replaces
``inspect.getfile`` and two helpers of ``typing``), so a process that had imported torch (an
elastic group's warm standby) trained and evaluated on other text than its peers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import subprocess
import sys
import unicodedata

import numpy as np

#: Pure-Python (or well-documented) standard-library modules, visited in this order.
MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "difflib", "enum", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.client",
    "inspect", "ipaddress", "json", "logging", "mimetypes", "numbers", "optparse", "pathlib",
    "pickle", "pprint", "queue", "random", "shlex", "shutil", "statistics", "string",
    "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing",
    "unittest", "urllib.parse", "uuid", "warnings", "zipfile",
)  # fmt: skip

#: Default cap on the corpus size, in characters (= bytes, the text being ASCII).
DEFAULT_MAX_CHARS = 300_000


def _to_ascii(text: str) -> str:
    """Normalises `text` to 7-bit ASCII: accents decomposed and dropped, tabs expanded."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return text.expandtabs(4).replace("\r", "")


def _member_docs(obj: object, module_name: str) -> list[str]:
    """Docstrings of the classes and routines defined in `obj` (a module or a class).

    Members are visited in sorted-name order; only those whose `__module__` is `module_name`
    are kept, so re-exported objects are not collected twice.
    """
    docs = []
    for name in sorted(vars(obj)):
        member = vars(obj)[name]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        if getattr(member, "__module__", None) != module_name:
            continue
        doc = member.__doc__  # own docstring only: `inspect.getdoc` would add inherited ones
        if isinstance(doc, str):
            docs.append(inspect.cleandoc(doc))
        if inspect.isclass(member) and not isinstance(obj, type):
            docs.extend(_member_docs(member, module_name))  # methods of top-level classes
    return docs


@functools.cache
def corpus_text(max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """Returns the corpus: stdlib docstrings, ASCII, separated by blank lines, gathered in a
    fresh interpreter (module docstring).

    Args:
      max_chars: the text is cut at this many characters.

    Returns:
      A deterministic (for a given Python version) ASCII string of at most `max_chars` chars.
    """
    if max_chars <= 0:
        raise ValueError(f"corpus max_chars must be positive, got {max_chars}")
    done = subprocess.run(
        [sys.executable, "-I", __file__, str(int(max_chars))],
        capture_output=True,
        check=True,
    )
    return done.stdout.decode("ascii")


def _gather(max_chars: int) -> str:
    """The corpus gathered in this interpreter, as its imports left the standard library."""
    seen: set[str] = set()
    parts: list[str] = []
    total = 0
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        docs = [inspect.cleandoc(module.__doc__ or "")] + _member_docs(module, module_name)
        for doc in docs:
            doc = _to_ascii(doc).strip()
            if len(doc) < 20 or doc in seen:  # skip one-liners like "Return self."
                continue
            seen.add(doc)
            parts.append(doc)
            total += len(doc) + 2
            if total >= max_chars:
                return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)[:max_chars]


@functools.cache
def corpus_tokens(max_chars: int = DEFAULT_MAX_CHARS) -> np.ndarray:
    """Returns the corpus as a read-only uint8 array of byte tokens (all < 128).

    Args:
      max_chars: passed to `corpus_text`.

    Returns:
      A 1-D read-only `np.uint8` array, one token per character.
    """
    tokens = np.frombuffer(corpus_text(max_chars).encode("ascii"), dtype=np.uint8)
    tokens.setflags(write=False)
    return tokens


def decode(tokens: np.ndarray | list[int]) -> str:
    """Turns byte tokens back into text (tokens >= 128 become '?')."""
    return "".join(chr(t) if 0 <= t < 128 else "?" for t in np.asarray(tokens).tolist())


def encode(text: str) -> np.ndarray:
    """Turns text into int32 byte tokens, normalising it to ASCII first."""
    return np.frombuffer(_to_ascii(text).encode("ascii"), dtype=np.uint8).astype(np.int32)


if __name__ == "__main__":  # the fresh interpreter of `corpus_text`
    sys.stdout.write(_gather(int(sys.argv[1])))
