"""`python -m trainers.new DIR`: a ready experiment repo on xshard, written into a new dir.

The repo (in the manner of lightning-hydra-template) is the template files of
``trainers/app/scaffold_files/`` (shipped in the wheel), in which the package name
``my_experiments`` and the project name ``my-experiments`` are replaced by the chosen ones:
a pyproject with ``xshard`` as a dependency and the ``xshard.allowed_targets`` entry point, a
Hydra app (``train.py``), a primary config composing ``xshard_train``, a Flax NNX model and
Grain data wired for ``precision`` and ``trainer.remat``, one experiment, a sweep, tests and a
Makefile. Its model, data, task node, experiment and ``train.py`` are those of
``examples/experiment_repo`` (a test checks that they agree).

Nothing is ever overwritten: the target must be a new or empty dir, and each file is created
exclusively. A bad target or name is a `ConfigError` (one line, exit 2).
"""

from __future__ import annotations

import keyword
import re
import sys
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import NamedTuple

from xshard.errors import ConfigError

#: The package and project names the templates are written with.
TEMPLATE_PACKAGE, TEMPLATE_PROJECT = "my_experiments", "my-experiments"
#: Template file names that are written under another name (hidden files are not globbed
#: into a wheel's package data).
RENAMED = {"gitignore": ".gitignore"}
#: Names a package of the repo may not take: what it needs imported (its package would shadow
#: them, or they it) and the repo's own top-level files and dirs.
RESERVED = frozenset(
    {"xshard", "trainers", "hydra", "hydra_plugins", "omegaconf", "jax", "jaxlib", "flax",
     "grain", "optax", "orbax", "numpy", "pytest", "conf", "tests", "train", "outputs"}
)  # fmt: skip
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class Scaffold(NamedTuple):
    """A written repo: its dir, its package (module) name and its files (relative paths)."""

    root: Path
    package: str
    files: list[str]


def check_package(name: str, origin: str = "--package") -> str:
    """Returns `name` if it can name the repo's Python package.

    Args:
      name: the package name.
      origin: where it came from, for the message (``--package``, or the dir it is named
        after).

    Raises:
      ConfigError: naming the value, where it came from and the rule it breaks.
    """
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        rule = (
            "is not a package name: use lower-case letters, digits and '_', starting with a letter"
        )
    elif name in RESERVED or name in sys.stdlib_module_names:
        rule = "is taken by a module the repo imports or by one of its own files"
    else:
        return name
    raise ConfigError(
        f"package name {name!r} ({origin}) {rule}; give one with --package NAME (e.g. lm_study)."
    )


def package_for(root: Path, package: str | None) -> str:
    """The package name: `package`, else the target dir's name with '-' as '_'.

    Raises:
      ConfigError: the name is not a usable package name.
    """
    if package is not None:
        return check_package(package)
    name = root.resolve().name
    return check_package(name.replace("-", "_"), origin=f"the name of {root}")


def check_target(root: Path) -> None:
    """Refuses a target that exists and is not an empty dir.

    Raises:
      ConfigError: naming the path and what it is.
    """
    if root.is_dir():
        if any(root.iterdir()):
            raise ConfigError(
                f"{root} is not empty: trainers.new writes only into a new or empty dir, "
                "never over files; give a new path."
            )
    elif root.exists() or root.is_symlink():
        raise ConfigError(f"{root} exists and is not a dir; give a new path.")


def templates() -> dict[str, str]:
    """The template files: relative path (with the template names) -> text."""
    files: dict[str, str] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".tmpl"):
                files[prefix + child.name.removesuffix(".tmpl")] = child.read_text("utf-8")

    walk(resources.files("trainers.app") / "scaffold_files", "")
    return files


def render(package: str) -> dict[str, str]:
    """The repo's files for the package name `package`: relative path -> text."""
    project = package.replace("_", "-")

    def named(text: str) -> str:
        return text.replace(TEMPLATE_PACKAGE, package).replace(TEMPLATE_PROJECT, project)

    out = {}
    for rel, text in templates().items():
        parts = [RENAMED.get(part, part) for part in named(rel).split("/")]
        out["/".join(parts)] = named(text)
    return out


def write(root: str | Path, package: str | None = None) -> Scaffold:
    """Writes the repo into `root` (created if missing; it must be empty).

    Args:
      root: the new repo's dir, relative to the working directory.
      package: its Python package; None: `root`'s name with '-' as '_'.

    Returns:
      The repo written.

    Raises:
      ConfigError: `root` is not a new or empty dir, or the package name is not usable.
    """
    path = Path(root).expanduser().absolute()
    check_target(path)
    name = package_for(path, package)
    files = render(name)
    path.mkdir(parents=True, exist_ok=True)
    for rel, text in sorted(files.items()):
        target = path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("x", encoding="utf-8") as f:  # never over a file
            f.write(text)
    return Scaffold(path, name, sorted(files))
