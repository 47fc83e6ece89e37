"""The wheel of this tree and a fresh virtual environment with it installed: module fixtures
shared by the tests that run xshard as an installed package (tests/conftest.py registers
them), and `run_app`, which runs a script there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests import REPO

PACKAGE_DIRS = ("xshard", "trainers", "hydra_plugins")
_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "outputs", "multirun", "__pycache__", "*.egg-info"
)


def _copy_tree(dst: Path) -> None:
    """Copies the files git would see (tracked or not ignored); the whole tree without git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dst, ignore=_IGNORE)
        return
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tree the wheel is built from (a copy, so the build leaves the checkout clean)."""
    src = tmp_path_factory.mktemp("wheel") / "src"
    _copy_tree(src)
    return src


@pytest.fixture(scope="module")
def wheel(source) -> Path:
    dist = source.parent / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (whl,) = dist.glob("xshard-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; the dependencies come from this environment."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A bare path line only extends sys.path: the .pth files there (this environment's
    # editable install of xshard) are not run, so xshard can only come from the wheel.
    (Path(site) / "_deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run_app(
    python: Path, repo: Path, *args: str, app: str = "app.py"
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HYDRA_FULL_ERROR"] = "0"
    return subprocess.run(
        [str(python), app, *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
