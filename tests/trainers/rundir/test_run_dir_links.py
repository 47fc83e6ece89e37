"""Symbolic links planted in a copied run dir never redirect the run's writes out of it.

A run dir copied or moved from elsewhere is untrusted (trainers/rundir/links.py). Each slow
test does what an attacker would: a real run, a copy of its dir, a link in the copy to a file
or folder outside it that the test owns, a rerun in the copy with the real CLI. The rerun must
exit 2 with one line naming the link, leave the target byte-for-byte unchanged (no new file
in a target folder), and leave the original run's checkpoints valid. The pieces are checked
in-process in test_run_dir_writes.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.cli import ONE_PATH
from tests.reliability_helpers import (
    SECRET,
    load_state,
    snapshot,
    steps_snapshot,
    truncate_data,
)
from trainers.checkpoint.io import complete_steps
from trainers.checkpoint.owner import LOCK_FILE
from trainers.config.run_names import short_name
from trainers.exits import EXIT_CONFIG_ERROR
from xshard.config import one_line

COMMON = [
    ONE_PATH,
    "task=mlp",
    "trainer.batch_size=16",
    "trainer.layer_stats_every=0",
    "trainer.histogram_every=0",
    "checkpoint.every_steps=2",
]
FIRST = [*COMMON, "trainer.steps=4"]  # the original run: checkpoints 2 and 4
RERUN = [*COMMON, "trainer.steps=6"]  # the rerun in the copy: train on to step 6


def cli(run_dir: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    """`python -m trainers.train` with `overrides` in `run_dir` (the sweep dir if `multirun`)."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "trainers.train",
            *(["-m"] if multirun else []),
            "trainer.progress=false",
            *overrides,
            where,
        ],
        cwd=REPO,
        env={**os.environ, "HYDRA_FULL_ERROR": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # callers assert the exit status
    )


def refused(result: subprocess.CompletedProcess, link: Path) -> str:
    """Exit 2, exactly one line on stderr (``xshard: error: ...``) naming `link`."""
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == EXIT_CONFIG_ERROR, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), output
    assert f"{one_line(str(link))} is a symbolic link" in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr, output
    return lines[0]


def run_name(overrides: list[str]) -> str:
    """The TensorBoard folder name of a run with `overrides` (`trainers.config.resolvers`,
    ``logger.run_names=short``)."""
    return short_name(sorted(overrides))


# --------------------------------------------------------------------------------------------
# End to end: a copied run dir with a planted link
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """A finished run with checkpoints 2 and 4."""
    run = tmp_path_factory.mktemp("links") / "original"
    result = cli(run, *FIRST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["2", "4"]
    return run


def outside_targets(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a folder (holding one file) outside any run dir, owned by the test."""
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "file").write_bytes(SECRET)
    (outside / "folder" / "kept").write_bytes(SECRET)
    return outside / "file", outside / "folder"


def plant(link: Path, target: Path) -> None:
    """Replaces whatever is at `link` by a symbolic link to `target`."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    elif link.exists() or link.is_symlink():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def tb_folder(run: Path) -> str:
    (folder,) = [p.name for p in (run / "tb").iterdir()]
    return folder


CSV = ["logger=[tensorboard,csv]"]
WANDB = ["logger=[tensorboard,wandb]", "logger.wandb.mode=offline"]
#: (id, the link in the copy, "file" or "folder" as its target, the rerun's extra overrides)
ATTACKS = [
    ("lock_file", f"checkpoints/{LOCK_FILE}", "file", []),
    ("log_file", "train.log", "file", []),
    ("tb_run_folder", f"tb/{run_name(RERUN)}", "folder", []),
    ("tb", "tb", "folder", []),
    ("checkpoints", "checkpoints", "folder", []),
    ("config_dump", ".hydra", "folder", []),
    ("config_dump_file", ".hydra/config.yaml", "file", []),
    ("result", "result.json", "file", []),
    ("result_tmp", "result.json.tmp", "file", []),
    # Every file and folder a logger writes (trainers.rundir.outputs).
    ("csv", "metrics.csv", "file", CSV),
    ("csv_config", "metrics.config.yaml", "file", CSV),
    ("csv_hparams", "metrics.hparams.json", "file", CSV),
    ("wandb", "wandb", "folder", WANDB),
    ("wandb_latest_run", "wandb/latest-run", "folder", WANDB),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "relative, kind, extra", [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS]
)
def test_a_planted_link_is_refused_and_nothing_is_written_outside(
    original, tmp_path, relative, kind, extra
):
    ours = steps_snapshot(original / "checkpoints")
    file, folder = outside_targets(tmp_path)
    outside = snapshot(file.parent)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    if relative.startswith("tb/"):  # the link alone in tb/, named as the rerun's folder
        shutil.rmtree(copy / "tb" / tb_folder(copy))
    link = copy / relative
    plant(link, file if kind == "file" else folder)

    line = refused(cli(copy, *RERUN, *extra), link)
    assert "outside the run dir" in line

    assert snapshot(file.parent) == outside  # byte for byte, and no new file
    assert link.is_symlink()
    assert steps_snapshot(original / "checkpoints") == ours
    assert load_state(original / "checkpoints" / "4")["['step']"] == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "relative, extra", [("train.log", []), ("metrics.csv", CSV)], ids=["log_file", "csv"]
)
def test_a_hard_link_the_run_would_append_to_is_refused(original, tmp_path, relative, extra):
    ours = steps_snapshot(original / "checkpoints")
    file, _ = outside_targets(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    log_before = (copy / "train.log").read_bytes()
    link = copy / relative
    link.unlink(missing_ok=True)
    link.hardlink_to(file)

    result = cli(copy, *RERUN, *extra)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == EXIT_CONFIG_ERROR, output
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"xshard: error: {link} is a hard link: the file has 2 names, and the others may lie "
        "outside the run dir. A run dir copied or moved from elsewhere may hold such a file, so "
        "the run refuses to start and appends nothing to it. Remove that name, or replace it "
        "by a copy of the file."
    ], output
    assert file.read_bytes() == SECRET and file.stat().st_nlink == 2
    if relative != "train.log":  # the log written before is kept; the rerun appends to it
        assert (copy / "train.log").read_bytes().startswith(log_before)
    assert complete_steps(copy / "checkpoints") == [2, 4]  # nothing trained, nothing saved
    assert load_state(copy / "checkpoints" / "4")["['step']"] == 4
    assert steps_snapshot(original / "checkpoints") == ours


@pytest.mark.slow
def test_a_copied_run_dir_of_every_file_logger_reruns_in_the_copy(tmp_path):
    """The normal use: W&B's own links in ``wandb/`` are relative, so they stay inside a copy;
    the rerun resumes, appends to ``metrics.csv`` and writes nothing in the original."""
    loggers = ["logger=[tensorboard,csv,wandb]", "logger.wandb.mode=offline"]
    first = tmp_path / "first"
    result = cli(first, *FIRST, *loggers)
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(p.is_symlink() for p in (first / "wandb").iterdir())  # W&B's latest-run
    before = snapshot(first)
    copy = tmp_path / "copy"
    shutil.copytree(first, copy, symlinks=True)

    rerun = cli(copy, *RERUN, *loggers)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Restored step 4 from" in rerun.stdout
    steps = [line.split(",")[0] for line in (copy / "metrics.csv").read_text().splitlines()]
    assert steps[0] == "step" and {"1", "4", "5", "6"} <= set(steps[1:])
    assert snapshot(first) == before


@pytest.mark.slow
def test_a_linked_corrupt_folder_is_refused_before_a_corrupted_step_is_moved(original, tmp_path):
    ours = steps_snapshot(original / "checkpoints")
    _, folder = outside_targets(tmp_path)
    outside = snapshot(folder.parent)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    truncate_data(copy / "checkpoints" / "4")  # the fallback would move step 4 aside...
    plant(copy / "checkpoints.corrupt", folder)  # ...into this folder, outside the copy
    corrupted = snapshot(copy / "checkpoints" / "4")

    refused(cli(copy, *RERUN, "checkpoint.fallback_to_previous=true"), copy / "checkpoints.corrupt")

    assert snapshot(folder.parent) == outside
    assert snapshot(copy / "checkpoints" / "4") == corrupted  # not moved
    assert steps_snapshot(original / "checkpoints") == ours
    assert load_state(original / "checkpoints" / "4")["['step']"] == 4


@pytest.mark.slow
def test_a_link_in_tb_is_never_taken_for_the_runs_folder(original, tmp_path):
    """A link in ``tb/`` under another name is not followed: the rerun writes a new folder."""
    _, folder = outside_targets(tmp_path)
    outside = snapshot(folder.parent)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    plant(copy / "tb" / tb_folder(copy), folder)  # the original's folder, not the rerun's

    result = cli(copy, *RERUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert snapshot(folder.parent) == outside
    assert any((copy / "tb" / run_name(RERUN)).glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_a_copied_sweep_dir_with_a_linked_config_dump_is_refused(tmp_path):
    _, folder = outside_targets(tmp_path)
    outside = snapshot(folder.parent)
    sweep = tmp_path / "sweep"
    first = cli(sweep, *FIRST, multirun=True)
    assert first.returncode == 0, first.stderr[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(sweep, copy, symlinks=True)
    (job,) = [p for p in copy.iterdir() if (p / ".hydra").is_dir()]
    plant(job / ".hydra", folder)

    refused(cli(copy, *FIRST, multirun=True), job / ".hydra")
    assert snapshot(folder.parent) == outside
