"""The pieces that keep a run's writes inside its run dir, in-process: the start-up check of
links, the log file handler, appends that never go through a symbolic or hard link, and files
written over a link, never through it (the CLI attacks are in test_run_dir_links.py)."""

from __future__ import annotations

import logging

import pytest

from tests.reliability_helpers import SECRET
from trainers.app.sweep import write_result
from trainers.checkpoint.owner import LOCK_FILE, claim_checkpoint_dir
from trainers.exits import LinkOutOfRunDirError
from trainers.hooks.csv_logger import CsvSink
from trainers.hooks.log_sink import RunInfo
from trainers.rundir.links import check_run_dir, outside_link, write_file
from trainers.rundir.log_file import RunLogFile
from trainers.rundir.outputs import Outputs, open_appended
from xshard.errors import ConfigError

# --------------------------------------------------------------------------------------------
# In-process: the check, the log file, the writes
# --------------------------------------------------------------------------------------------


def test_links_out_of_the_run_dir_are_found_links_inside_it_are_not(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "checkpoints").mkdir(parents=True)
    (run / "real_tb").mkdir()
    outside.mkdir()
    (run / "tb").symlink_to(run / "real_tb")  # inside: harmless
    assert outside_link(run / "tb" / "x", [run]) is None
    check_run_dir(run, tb_dir=run / "tb" / "x", checkpoint_dir=run / "checkpoints")

    (run / "checkpoints.corrupt").symlink_to(outside)
    assert outside_link(run / "checkpoints.corrupt" / "4", [run]) == (
        str(run / "checkpoints.corrupt"),
        str(outside),
    )
    with pytest.raises(LinkOutOfRunDirError, match="checkpoints.corrupt is a symbolic link to"):
        check_run_dir(run, checkpoint_dir=run / "checkpoints")

    # A dangling link leads out too; a path configured outside the run dir is not checked.
    (run / "checkpoints.corrupt").unlink()
    (run / "result.json").symlink_to(outside / "missing")
    with pytest.raises(LinkOutOfRunDirError, match=r"result\.json is a symbolic link"):
        check_run_dir(run)
    (run / "result.json").unlink()
    elsewhere = tmp_path / "ckpt"
    (elsewhere / "0").parent.mkdir()
    (elsewhere / "0").symlink_to(outside)
    check_run_dir(run, checkpoint_dir=elsewhere)


def test_the_log_file_is_never_written_through_a_link(tmp_path, capfd):
    target = tmp_path / "target"
    target.write_bytes(SECRET)
    log = tmp_path / "run" / "train.log"
    log.parent.mkdir()
    log.symlink_to(target)
    handler = RunLogFile(log)
    logger = logging.getLogger("test_run_dir_links.link")
    logger.addHandler(handler)
    try:
        logger.warning("one")
        logger.warning("two")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert target.read_bytes() == SECRET and handler.problem is not None
    assert capfd.readouterr().err == ""  # the start-up check names the link, not the handler
    with pytest.raises(LinkOutOfRunDirError, match="train.log is a symbolic link"):
        check_run_dir(log.parent, log_files=[log])


def test_a_plain_log_file_is_appended_to(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("earlier\n")
    handler = RunLogFile(log)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test_run_dir_links.plain")
    logger.addHandler(handler)
    try:
        logger.warning("later")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert log.read_text() == "earlier\nlater\n" and handler.problem is None


def test_files_are_written_over_a_link_never_through_it(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(SECRET)
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").symlink_to(target)
    (run / "result.json.tmp").symlink_to(target)
    write_result(run, {"status": "completed"})
    assert target.read_bytes() == SECRET
    assert (
        not (run / "result.json").is_symlink()
        and '"completed"' in (run / "result.json").read_text()
    )
    assert sorted(p.name for p in run.iterdir()) == ["result.json"]

    (run / "note").symlink_to(target)
    write_file(run / "note", "new")
    assert target.read_bytes() == SECRET and (run / "note").read_text() == "new"


def test_a_file_the_run_appends_to_is_never_a_hard_link(tmp_path, capfd):
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").hardlink_to(victim)
    with pytest.raises(LinkOutOfRunDirError, match=r"train\.log is a hard link: the file has 2"):
        check_run_dir(run, log_files=[run / "train.log"])
    with pytest.raises(LinkOutOfRunDirError, match="is a hard link"):
        open_appended(run / "train.log")  # O_NOFOLLOW does not see it; the link count does
    with pytest.raises(LinkOutOfRunDirError, match="is a hard link"):
        open_appended(run / "train.log", truncate=True)  # checked before it truncates

    handler = RunLogFile(run / "train.log")  # at a hard link it writes nothing, silently
    logger = logging.getLogger("test_run_dir_links.hard")
    logger.addHandler(handler)
    try:
        logger.warning("one")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert victim.read_bytes() == SECRET and handler.problem is not None
    assert capfd.readouterr().err == ""

    (run / "metrics.csv").hardlink_to(victim)
    with pytest.raises(LinkOutOfRunDirError, match=r"metrics\.csv is a hard link"):
        check_run_dir(run, outputs=Outputs(appended=(str(run / "metrics.csv"),)))
    assert victim.read_bytes() == SECRET


def test_the_csv_loggers_files_are_written_over_links_never_through_them(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.config.yaml").symlink_to(victim)
    (run / "metrics.hparams.json").hardlink_to(victim)
    csv_logger = CsvSink(str(run / "metrics.csv"))
    assert csv_logger.outputs() == Outputs(
        appended=(str(run / "metrics.csv"),),
        replaced=(str(run / "metrics.config.yaml"), str(run / "metrics.hparams.json")),
    )
    csv_logger.start(RunInfo("r", {}, "seed: 1\n", {"seed": 1.0}))
    csv_logger.log_scalars(1, {"train/loss": 0.5})
    csv_logger.finish({"hparams/last_step": 1.0}, True)
    assert victim.read_bytes() == SECRET
    assert (run / "metrics.config.yaml").read_text() == "seed: 1\n"
    assert not (run / "metrics.config.yaml").is_symlink()
    assert (run / "metrics.hparams.json").stat().st_nlink == 1
    assert (run / "metrics.csv").read_text().splitlines() == [
        "step,name,value",
        "1,train/loss,0.5",
        "1,hparams/last_step,1.0",
    ]

    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(victim)
    with pytest.raises(LinkOutOfRunDirError, match=r"metrics\.csv is a symbolic link"):
        CsvSink(str(run / "metrics.csv")).start(RunInfo("r", {}, "", {}))
    assert victim.read_bytes() == SECRET


def test_a_linked_lock_file_is_refused_and_its_target_left_alone(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(SECRET)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError, match="its lock file .* is a symbolic link"):
        claim_checkpoint_dir(run / "checkpoints", run)
    assert target.read_bytes() == SECRET
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [LOCK_FILE]
