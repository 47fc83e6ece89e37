"""One run per checkpoint dir, in-process: who owns a dir, the lock, and that Orbax (listing,
saving, pruning) ignores the lock and owner files next to the step folders."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from tests.reliability_helpers import snapshot
from tests.trainers.checkpoint.test_checkpoints import CONFIG, synthetic_state
from trainers.checkpoint.owner import LOCK_FILE, OWNER_FILE, claim_checkpoint_dir, read_owner
from trainers.checkpoint.resume import complete_steps
from trainers.checkpoint.save import CheckpointHook
from trainers.config import CheckpointOptions
from trainers.exits import CheckpointDirInUseError, ForeignCheckpointDirError


def write_steps(directory: Path, *steps: int, keep: int | None = None) -> None:
    """Real Orbax checkpoints of a small state at `steps` (pruned to `keep`)."""
    hook = CheckpointHook(directory, CheckpointOptions(async_save=False, keep=keep), CONFIG)
    for step in steps:
        hook.save(step, synthetic_state((8,), step=step))
    hook.close()


@pytest.fixture
def claim():
    """`claim_checkpoint_dir`, with every lock taken released after the test."""
    locks = []

    def take(checkpoint_dir: Path, output_dir: Path, **kwargs):
        lock = claim_checkpoint_dir(checkpoint_dir, output_dir, **kwargs)
        locks.append(lock)
        return lock

    yield take
    for lock in locks:
        if lock is not None:
            lock.release()


def test_orbax_lists_saves_and_prunes_around_the_lock_and_owner_files(tmp_path, claim):
    run = tmp_path / "run"
    claim(run / "checkpoints", run)
    assert {p.name for p in (run / "checkpoints").iterdir()} == {LOCK_FILE, OWNER_FILE}

    write_steps(run / "checkpoints", 1, 2, 3, 4, keep=1)  # prunes 1, 2, 3 after each save

    assert complete_steps(run / "checkpoints") == [4]
    names = {p.name for p in (run / "checkpoints").iterdir()}
    assert names == {LOCK_FILE, OWNER_FILE, "4"}
    assert read_owner(run / "checkpoints")["output_dir"] == str(run.resolve())


def test_a_new_dir_is_claimed_and_records_the_run_and_the_lock_holder(tmp_path, claim):
    run = tmp_path / "run"
    claim(run / "checkpoints", run)
    owner = read_owner(run / "checkpoints")
    assert owner["output_dir"] == str(run.resolve())
    assert owner["checkpoint_dir"] == str((run / "checkpoints").resolve())
    holder = json.loads((run / "checkpoints" / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert holder["since"] and holder["output_dir"] == str(run.resolve())


def test_another_runs_dir_is_refused_before_anything_is_written(tmp_path, claim):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    lock = claim(run_a / "checkpoints", run_a)
    write_steps(run_a / "checkpoints", 1, 2)
    lock.release()  # run A ended
    before = snapshot(run_a)

    with pytest.raises(ForeignCheckpointDirError) as err:
        claim(run_a / "checkpoints", run_b)
    text = str(err.value)
    assert "\n" not in text
    assert f"holds checkpoints of another run (output dir {run_a.resolve()})" in text
    assert f"trainer.resume_from='{(run_a / 'checkpoints').resolve()}'" in text
    assert f"hydra.run.dir={run_a.resolve()}" in text
    assert snapshot(run_a) == before
    # Also when checkpoints are off (it would only resume from them), and empty of steps.
    with pytest.raises(ForeignCheckpointDirError):
        claim(run_a / "checkpoints", run_b, create=False)
    shutil.rmtree(run_a / "checkpoints" / "1")
    shutil.rmtree(run_a / "checkpoints" / "2")
    with pytest.raises(ForeignCheckpointDirError, match="belongs to another run"):
        claim(run_a / "checkpoints", run_b)


def test_checkpoints_without_owner_record_are_adopted_only_inside_the_run_dir(tmp_path, claim):
    legacy = tmp_path / "legacy"
    write_steps(legacy / "checkpoints", 5)  # written before owner records existed
    before = snapshot(legacy)

    with pytest.raises(ForeignCheckpointDirError) as err:
        claim(legacy / "checkpoints", tmp_path / "other")
    assert "no owner record" in str(err.value)
    assert f"hydra.run.dir={legacy.resolve()}" in str(err.value)
    assert snapshot(legacy) == before

    claim(legacy / "checkpoints", legacy)
    assert read_owner(legacy / "checkpoints")["output_dir"] == str(legacy.resolve())
    assert complete_steps(legacy / "checkpoints") == [5]


def test_a_copied_or_moved_run_dir_keeps_working_and_the_record_follows(tmp_path, claim):
    run = tmp_path / "run"
    claim(run / "checkpoints", run).release()
    write_steps(run / "checkpoints", 3)
    copy, moved = tmp_path / "copy", tmp_path / "moved"
    shutil.copytree(run, copy)

    claim(copy / "checkpoints", copy)
    assert read_owner(copy / "checkpoints")["output_dir"] == str(copy.resolve())
    assert read_owner(run / "checkpoints")["output_dir"] == str(run.resolve())

    shutil.move(run, moved)
    claim(moved / "checkpoints", moved)
    assert read_owner(moved / "checkpoints")["checkpoint_dir"] == str(
        (moved / "checkpoints").resolve()
    )


def test_a_dir_another_run_wrote_from_outside_is_not_taken_over_by_its_parent_run(tmp_path, claim):
    parent, outsider = tmp_path / "parent", tmp_path / "outsider"
    claim(parent / "checkpoints", outsider).release()  # paths.checkpoint_dir=parent/checkpoints
    write_steps(parent / "checkpoints", 2)
    with pytest.raises(ForeignCheckpointDirError, match=f"output dir {outsider.resolve()}"):
        claim(parent / "checkpoints", parent)


def test_a_live_lock_is_refused_naming_the_holder_and_a_released_one_is_not(tmp_path, claim):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    ckpt.mkdir(parents=True)
    # Another holder: flock locks belong to an open file, so a second open is another holder.
    fd = os.open(ckpt / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    holder = {"host": "node-7", "pid": 4242, "since": "2030-01-01T00:00:00+00:00"}
    os.write(fd, json.dumps({**holder, "output_dir": str(run)}).encode())
    try:
        with pytest.raises(CheckpointDirInUseError) as err:
            claim(ckpt, run)
        text = str(err.value)
        assert "\n" not in text and f"paths.checkpoint_dir='{ckpt.resolve()}' is in use" in text
        assert "pid 4242 on host node-7 since 2030-01-01T00:00:00+00:00" in text
        assert read_owner(ckpt) is None  # refused before writing the owner record
    finally:
        os.close(fd)  # what the OS does for a process that died, kill -9 included

    assert (ckpt / LOCK_FILE).exists()  # a stale lock file is not a lock
    claim(ckpt, run)
    assert json.loads((ckpt / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_other_processes_and_runs_without_checkpoints_write_nothing(tmp_path, claim):
    run = tmp_path / "run"
    assert claim(run / "checkpoints", run, lead=False) is None
    assert claim(run / "checkpoints", run, create=False) is None
    assert not (run / "checkpoints").exists()
