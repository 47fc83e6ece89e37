"""The trust rule applied inside Hydra's composition, before Hydra acts on any of it.

Hydra acts on the ``hydra`` node of the composed config before any task code runs: it
instantiates ``hydra.callbacks``, hands ``hydra.job_logging`` to `logging.config.dictConfig`
(whose ``()`` key calls any factory), exports ``hydra.job.env_set``, lets the Optuna sweeper
instantiate ``hydra.sweeper.sampler``, turns every ``hydra.sweeper.params`` entry into an
override of each job, and appends the real command line to ``hydra.overrides.task`` after
whatever a file wrote there. So the check cannot wait for the task function:
`guard_compositions` runs `trainers.app.trust`'s rule on every file of each defaults list Hydra
composes (the run's, each multirun job's, ``--cfg``'s, the doctor's), before the files are
merged, and a refused file ends the process with one line and exit status 2. A sweep's
search space is checked as the file writes it, so the overrides the sweeper builds for its jobs
hold nothing the rule refuses; each job's own composition is checked again.

Nothing here resolves an interpolation or imports a target: keys are read as written.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from trainers.app.trust import ComposedFile, at_root, refusals
from trainers.exits import UntrustedConfigError
from xshard.config.targets import ALLOWED_TARGETS_KEY

#: Config sources whose files come with installed packages, and so are trusted.
TRUSTED_SCHEMES = ("pkg", "structured")


def check_file(
    file: ComposedFile,
    granted: frozenset[str] = frozenset(),
    declared: frozenset[str] | None = None,
) -> None:
    """Refuses `file` if it sets a key its origin may not set (`trainers.app.trust`).

    Args:
      file: the file.
      granted: the ``allowed_targets`` entries trusted sources grant (`granted_entries`).
      declared: the top-level keys trusted sources declare (`declared_keys`); None: any.

    Raises:
      UntrustedConfigError: naming the file, the first such key and why.
    """
    refused = refusals(file, granted, declared)
    if refused:
        key, why = refused[0]
        raise UntrustedConfigError(
            f"config file {file.name} sets {key}, which a config file that is not trusted may "
            f"not set: {why}."
        )


def declared_keys(defaults: Sequence[Any], files: Sequence[ComposedFile]) -> frozenset[str]:
    """The top-level keys that trusted sources declare in one composition: those the trusted
    files among `files` set, and the packages of the groups their defaults lists choose
    (``task`` for ``xshard_train``'s ``task: mlp``, whichever file the option comes from)."""
    paths = {f.config_path for f in files if f.trusted}
    roots = {key for f in files if f.trusted for key in at_root(f)}
    chosen = [d for d in defaults if d.parent in paths and d.config_path]
    roots |= {d.package.split(".")[0] for d in chosen if d.package}
    roots |= {d.config_path.split("/")[0] for d in chosen if "/" in d.config_path}
    return frozenset(roots | {"hydra"})


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
        root = at_root(file)
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


def _defaults_specs(loaded: Any) -> list[str]:
    """A loaded file's defaults list as ``group@package`` strings, as written (Hydra's parsed
    ``InputDefault`` items: a group default's group, a config default's path)."""
    specs = []
    for item in loaded.defaults_list or []:
        where = getattr(item, "group", None) or getattr(item, "path", None) or ""
        specs.append(f"{where}@{item.package}" if item.package else where)
    return specs


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
        if isinstance(content, dict):
            content["defaults"] = _defaults_specs(loaded)
        trusted = installed or default.primary
        yield ComposedFile(name, trusted, default.package or "", content, default.config_path)


def shadowed_files(defaults: Sequence[Any], repo: Any) -> Iterator[str]:
    """One line for each option of the defaults list that an installed package's config
    dir supplied while a ``file://`` dir (``--config-dir``, ``hydra.searchpath``) also has a
    file of that name: Hydra takes the first source in the search path that has it."""
    for default in defaults:
        path = default.config_path
        if path is None or default.primary:
            continue
        sources = [s for s in repo.get_sources() if s.available() and s.is_config(path)]
        if len(sources) > 1 and sources[0].scheme() != "file":
            mine = next((s for s in sources if s.scheme() == "file"), None)
            if mine is not None:
                yield (
                    f"{mine.path}/{path}.yaml is not used: {sources[0].full_path()}/{path}.yaml "
                    "comes first in the config search path (the primary config's own dir "
                    "first, --config-dir after it): give your option another name, or make "
                    "your dir the primary config's (--config-name from it, or your own app)"
                )


def check_defaults(defaults: Sequence[Any], repo: Any, warned: set[str] | None = None) -> None:
    """Refuses a defaults list if any of its files sets a key its origin may not set, and
    warns once (on stderr, collected in `warned`) about each file of a config dir of the user's
    that an installed one shadows (`shadowed_files`).

    Raises:
      UntrustedConfigError: naming the first such file and key.
    """
    files = list(composed_files(defaults, repo))
    granted = granted_entries(files)
    declared = declared_keys(defaults, files)
    for file in files:
        check_file(file, granted, declared)
    for line in shadowed_files(defaults, repo):
        if warned is not None and line not in warned:
            warned.add(line)
            print(f"xshard: warning: {line}", file=sys.stderr, flush=True)


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
    warned: set[str] = set()

    def checked(self: Any, defaults: list[Any], repo: Any) -> Any:
        try:
            check_defaults(defaults, repo, warned)
        except UntrustedConfigError as e:
            print(f"xshard: error: {e}", file=sys.stderr, flush=True)
            sys.exit(exit_code)
        return compose(self, defaults, repo)

    ConfigLoaderImpl._compose_config_from_defaults_list = checked  # type: ignore[method-assign]
    try:
        with readable_yaml(exit_code):
            yield
    finally:
        ConfigLoaderImpl._compose_config_from_defaults_list = compose  # type: ignore[method-assign]


def yaml_error_line(error: yaml.YAMLError) -> str:
    """One line for a config file that is not valid YAML: the file, the line and column, and
    what the parser expected (``PyYAML``'s own words)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a file"
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    return f"{where}: not valid YAML ({problem}); fix or remove the file"


@contextlib.contextmanager
def readable_yaml(exit_code: int) -> Iterator[None]:
    """While active, a config file Hydra loads that is not valid YAML (a copied file cut short,
    a tab in an indent) ends the process with one line (`yaml_error_line`) and `exit_code`,
    not Hydra's traceback from inside its loader (``ConfigRepository.load_config``, which
    every composition uses)."""
    from hydra._internal.config_repository import ConfigRepository

    load = ConfigRepository.load_config

    def loaded(self: Any, config_path: str) -> Any:
        try:
            return load(self, config_path)
        except yaml.YAMLError as e:
            print(f"xshard: error: {yaml_error_line(e)}", file=sys.stderr, flush=True)
            sys.exit(exit_code)

    ConfigRepository.load_config = loaded  # type: ignore[method-assign]
    try:
        yield
    finally:
        ConfigRepository.load_config = load  # type: ignore[method-assign]
