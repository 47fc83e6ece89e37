"""What each composed config file may set, checked inside Hydra's composition.

Threat model (docs/reliability.md): code a user installs is trusted; a config file copied from
elsewhere is not; what the user types on the command line is theirs. Hydra acts on the
``hydra`` node of the composed config before any task code runs: it instantiates
``hydra.callbacks``, hands ``hydra.job_logging`` to `logging.config.dictConfig` (whose ``()``
key calls any factory), exports ``hydra.job.env_set``, lets the Optuna sweeper instantiate
``hydra.sweeper.sampler``, composes every multirun job from ``hydra.overrides.hydra``, and
appends the real command line to ``hydra.overrides.task`` after whatever a file wrote there.
So the check cannot wait for the task function: `guard_compositions` runs it on every file of
each defaults list Hydra composes (the run's, each multirun job's, ``--cfg``'s), before the
files are merged, and a refused file ends the process with one line and exit status 2.

The rules (`refused_keys`):

- **Trusted files** (the primary config, and the files of installed packages: ``pkg://`` and
  ``structured://`` sources) may set anything but ``hydra.overrides``.
- **Other files** (``file://`` sources: ``--config-dir``, ``hydra.searchpath``, a repo's own
  config dir) may set ``hydra`` keys under `UNTRUSTED_HYDRA_KEYS` only, never
  ``hydra.overrides``, and ``allowed_targets`` only to entries a trusted source already grants
  (a trusted file, the command line, ``XSHARD_ALLOWED_TARGETS``, an installed package:
  `trainers.app.allowlist`), so a sweep file may repeat its experiment's list but not widen it.
  Put anything else in your primary config or on the command line.

Nothing here resolves an interpolation or imports a target: keys are read as written.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import OmegaConf

from trainers.errors import UntrustedConfigError
from xshard.targets import ALLOWED_TARGETS_KEY

#: Config sources whose files come with installed packages, and so are trusted.
TRUSTED_SCHEMES = ("pkg", "structured")

#: The ``hydra`` keys a file that is neither the primary config nor installed may set: where
#: outputs go, the job's name, and the search space of a sweep (whose values are composed and
#: checked like any override). Hydra ignores ``hydra.searchpath`` outside the primary config.
UNTRUSTED_HYDRA_KEYS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "hydra.job.name",
    "hydra.job.chdir",
    "hydra.mode",
    "hydra.searchpath",
    "hydra.sweeper.params",
    "hydra.sweeper.direction",
    "hydra.sweeper.n_trials",
    "hydra.sweeper.n_jobs",
    "hydra.sweeper.max_failure_rate",
    "hydra.sweeper.study_name",
)

#: Keys no config file may set: Hydra records the real overrides there after composing.
FORGED_KEY = "hydra.overrides"


class ComposedFile(NamedTuple):
    """One file of a defaults list, as Hydra loaded it (nothing resolved).

    Attributes:
      name: where it was read from, for messages (a path, or ``pkg://module/name.yaml``).
      trusted: the primary config, or a file of an installed package.
      package: the config node its content lands in ("" for the root).
      content: its keys and values as written (its defaults list left out).
    """

    name: str
    trusted: bool
    package: str
    content: Any


def _dotted(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """The dotted key and value of every leaf of `node` (an empty dict is a leaf)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, _dotted(prefix, key))
    else:
        yield prefix, node


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _at_root(file: ComposedFile) -> dict[str, Any]:
    """`file`'s content placed at its package in the root config (its defaults list left out)."""
    content = file.content if isinstance(file.content, dict) else {}
    node: Any = {k: v for k, v in content.items() if k != "defaults"}
    for part in reversed(file.package.split(".") if file.package else []):
        node = {part: node}
    return node


def widening_entries(file: ComposedFile, granted: frozenset[str]) -> list[str]:
    """The ``allowed_targets`` entries an untrusted `file` writes beyond `granted`.

    An entry that cannot be read in that file alone (an interpolation of a key set elsewhere,
    not a string) counts as widening.
    """
    from trainers.app.allowlist import file_entries

    root = _at_root(file)
    if file.trusted or ALLOWED_TARGETS_KEY not in root:
        return []
    entries = file_entries(root[ALLOWED_TARGETS_KEY])
    return [
        repr(e) if e is not None else "an entry read elsewhere" for e in entries if e not in granted
    ]


def refused_keys(file: ComposedFile, granted: frozenset[str] = frozenset()) -> list[str]:
    """The keys `file` sets that its origin may not set (module docstring), in file order.

    Args:
      file: the file.
      granted: the ``allowed_targets`` entries trusted sources grant (`granted_entries`).
    """
    refused = []
    for key, value in _leaves(_at_root(file), ""):
        if _under(key, FORGED_KEY):  # Hydra's own schema declares it empty
            if value or not file.trusted:
                refused.append(key)
        elif file.trusted or _under(key, ALLOWED_TARGETS_KEY):
            continue
        elif _under(key, "hydra") and not any(_under(key, ok) for ok in UNTRUSTED_HYDRA_KEYS):
            refused.append(key)
    if widening_entries(file, granted):
        refused.append(ALLOWED_TARGETS_KEY)
    return refused


def _why(key: str) -> str:
    if _under(key, FORGED_KEY):
        return "Hydra records the real command line there, so no config file may set it"
    if _under(key, ALLOWED_TARGETS_KEY):
        return (
            f"only the primary config, the command line (+{ALLOWED_TARGETS_KEY}=[mypkg.]), "
            "XSHARD_ALLOWED_TARGETS or an installed package may widen the allowlist (a copied "
            "file may only repeat what they grant)"
        )
    return (
        "Hydra acts on it before the run starts, so only the primary config, the command line "
        f"or an installed package may set it; other files may set {', '.join(UNTRUSTED_HYDRA_KEYS)}"
    )


def check_file(file: ComposedFile, granted: frozenset[str] = frozenset()) -> None:
    """Refuses `file` if it sets a key its origin may not set.

    Args:
      file: the file.
      granted: the ``allowed_targets`` entries trusted sources grant (`granted_entries`).

    Raises:
      UntrustedConfigError: naming the file, the first such key and why.
    """
    refused = refused_keys(file, granted)
    if not refused:
        return
    if refused[0] == ALLOWED_TARGETS_KEY:
        widening = ", ".join(widening_entries(file, granted))
        raise UntrustedConfigError(
            f"config file {file.name} sets {ALLOWED_TARGETS_KEY} to {widening}, which no "
            f"trusted source grants: {_why(ALLOWED_TARGETS_KEY)}."
        )
    raise UntrustedConfigError(
        f"config file {file.name} sets {refused[0]}, which a composed config file may not "
        f"set: {_why(refused[0])}."
    )


def granted_entries(files: Sequence[ComposedFile]) -> frozenset[str]:
    """The ``allowed_targets`` entries of the trusted sources of one composition.

    The trusted files among `files` (entries resolved in each file alone), the command line,
    ``XSHARD_ALLOWED_TARGETS`` and installed packages (`trainers.app.allowlist`).
    """
    from trainers.app.allowlist import (
        argv_overrides,
        command_line_entries,
        environment_entries,
        file_entries,
        installed_entries,
    )

    granted = command_line_entries(argv_overrides()) | environment_entries() | installed_entries()
    for file in files:
        root = _at_root(file)
        if file.trusted and ALLOWED_TARGETS_KEY in root:
            granted |= {e for e in file_entries(root[ALLOWED_TARGETS_KEY]) if e is not None}
    return frozenset(granted)


def _source_name(source_path: str, config_path: str) -> tuple[str, bool]:
    """A file's name for messages, and whether its source is an installed package's."""
    scheme, sep, where = source_path.partition("://")
    if not sep:  # Hydra reads a search path entry without a scheme as a directory
        scheme, where = "file", source_path
    if scheme == "file":
        return str(Path(where) / f"{config_path}.yaml"), False
    return f"{source_path}/{config_path}.yaml", scheme in TRUSTED_SCHEMES


def composed_files(defaults: Sequence[Any], repo: Any) -> Iterator[ComposedFile]:
    """The files of a Hydra defaults list, loaded as Hydra loads them.

    Args:
      defaults: ``DefaultsList.defaults`` (Hydra's ``ResultDefault`` items).
      repo: the config repository Hydra composes from.
    """
    for default in defaults:
        if default.config_path is None:
            continue
        loaded = repo.load_config(config_path=default.config_path)
        if loaded is None:
            continue
        name, installed = _source_name(loaded.path, default.config_path)
        content = OmegaConf.to_container(loaded.config, resolve=False)
        yield ComposedFile(name, installed or default.primary, default.package or "", content)


def check_defaults(defaults: Sequence[Any], repo: Any) -> None:
    """Refuses a defaults list if any of its files sets a key its origin may not set.

    Raises:
      UntrustedConfigError: naming the first such file and key.
    """
    files = list(composed_files(defaults, repo))
    granted = granted_entries(files)
    for file in files:
        check_file(file, granted)


@contextlib.contextmanager
def guard_compositions(exit_code: int) -> Iterator[None]:
    """Checks every defaults list that Hydra composes in this process while active.

    Hydra composes through ``ConfigLoaderImpl._compose_config_from_defaults_list`` (the run,
    each job of a multirun, ``--cfg``, ``--help``); while this context is active that method
    first runs `check_defaults`. A refused file prints one line on stderr and exits with
    `exit_code`: Hydra would report an exception with status 1 and go on to sweep.

    Args:
      exit_code: the exit status of a refused composition (bad config).
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    compose = ConfigLoaderImpl._compose_config_from_defaults_list

    def checked(self: Any, defaults: list[Any], repo: Any) -> Any:
        try:
            check_defaults(defaults, repo)
        except UntrustedConfigError as e:
            print(f"xshard: error: {e}", file=sys.stderr, flush=True)
            sys.exit(exit_code)
        return compose(self, defaults, repo)

    ConfigLoaderImpl._compose_config_from_defaults_list = checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigLoaderImpl._compose_config_from_defaults_list = compose  # type: ignore[method-assign]
