"""I/O faults end to end, the real CLI in subprocesses (all slow): a full disk for checkpoints,
for TensorBoard and for the run dir itself (its log file and result.json; small tmpfs mounts:
the tests run as root, else they skip), bad ``logger.*`` values. Each fault ends the run in
bounded time with one line on stderr (a full run dir: at most two more, each saying what could
not be written) and the documented exit status, and leaves earlier checkpoints valid."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import pytest

from tests.bounded_cli import TIMEOUT, assert_one_line_error, cli
from tests.reliability_helpers import fill, load_state, resize, tmpfs
from trainers.app.sweep import write_result
from trainers.checkpoint.io import complete_steps, unfinished_saves
from trainers.exits import EXIT_CONFIG_ERROR
from trainers.rundir.log_file import RunLogFile

pytestmark = [pytest.mark.slow, pytest.mark.long]

# --------------------------------------------------------------------------------------------
# Checkpoints on a full disk
# --------------------------------------------------------------------------------------------


def test_full_disk_for_checkpoints_fails_early_or_at_the_save_and_a_rerun_resumes(tmp_path):
    run, mnt = tmp_path / "run", tmp_path / "mnt"
    ckpt_dir = mnt / "checkpoints"
    overrides = [
        "trainer.steps=30",
        "checkpoint.every_steps=10",
        "checkpoint.keep=null",
        f"paths.checkpoint_dir={ckpt_dir}",
    ]
    with tmpfs(mnt, 64 * 1024):
        # A: too small for one checkpoint: refused at start-up, before any step.
        line = assert_one_line_error(cli(run, *overrides), EXIT_CONFIG_ERROR, "error")
        assert f"paths.checkpoint_dir='{ckpt_dir}'" in line
        needed = int(re.search(r"needs about ([\d,]+) bytes", line)[1].replace(",", ""))
        free = int(re.search(r"([\d,]+) bytes free", line)[1].replace(",", ""))
        assert free <= 64 * 1024 < needed
        assert complete_steps(ckpt_dir) == [] and not list((run / "tb").rglob("events.*"))

        # B: room for the estimate (about one checkpoint), not for three: the save that does
        # not fit fails with one line; the complete checkpoints before it stay valid.
        resize(mnt, needed + 64 * 1024)
        line = assert_one_line_error(cli(run, *overrides), EXIT_CONFIG_ERROR, "error")
        assert re.search(rf"Writing checkpoint step \d+ to {ckpt_dir} failed: No space left", line)
        assert f"needs about {needed:,} bytes" in line
        kept = complete_steps(ckpt_dir)
        assert kept and max(kept) < 30, line
        assert f"latest complete: step {max(kept)}" in line
        assert load_state(ckpt_dir / str(max(kept)))["['step']"] == max(kept)

        # Space freed: the same command resumes from the last complete checkpoint.
        resize(mnt, 8 * 1024 * 1024)
        resumed = cli(run, *overrides)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"Restored step {max(kept)} from" in resumed.stdout
        assert complete_steps(ckpt_dir)[-1] == 30 and unfinished_saves(ckpt_dir) == []


# --------------------------------------------------------------------------------------------
# TensorBoard on a full disk; bad logger config
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_full_disk_for_tensorboard_never_hangs(tmp_path, on_error):
    run, mnt = tmp_path / "run", tmp_path / "mnt"
    with tmpfs(mnt, 16 * 1024):
        fill(mnt)
        start = time.monotonic()
        result = cli(
            run,
            "trainer.steps=100",
            "checkpoint.every_steps=50",
            f"paths.tb_dir={mnt / 'tb'}",
            f"logger.on_error={on_error}",
        )
        assert time.monotonic() - start < TIMEOUT
    if on_error == "stop":  # stopped cleanly after the step that found it: checkpoint, exit 2
        line = assert_one_line_error(result, EXIT_CONFIG_ERROR, "error")
        assert f"TensorBoard events cannot be written to paths.tb_dir='{mnt / 'tb'}'" in line
        assert "No space left on device" in line and "logger.on_error=continue" in line
        # When the writer thread first hits the full disk depends on how many bytes the first
        # events take (the config text, the HParams entry) and on when the thread runs: before
        # training (the message says so) nothing is trained and nothing saved; after a step,
        # that step is saved.
        when = re.search(r"stopped cleanly (?:at step (\d+)|before training)", line)
        assert when is not None, line
        stopped = int(when[1] or 0)
        kept = complete_steps(run / "checkpoints")
        assert kept[-1:] == ([stopped] if stopped else []), (stopped, kept)
    else:  # trains to the end without events, and says so once
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stdout + result.stderr
        assert result.stdout.count("training continues without them") == 1
        assert complete_steps(run / "checkpoints")[-1] == 100


@pytest.mark.parametrize(
    "override, message",
    [
        ("logger.flush_secs=abc", "logger.flush_secs='abc': expected a number"),
        ("logger.flush_secs=-1", "logger.flush_secs=-1.0: expected"),
        ("logger.flush_secs=0", "logger.flush_secs=0.0: expected"),
        ("logger.flush_secs=nan", "logger.flush_secs=nan: expected"),
        ("logger.on_error=ignore", "logger.on_error='ignore': expected one of"),
        ("+logger.bogus=1", "logger.bogus: unknown key"),
    ],
)
def test_bad_logger_values_are_one_line_config_errors(tmp_path, override, message):
    line = assert_one_line_error(
        cli(tmp_path / "run", "trainer.steps=3", override), EXIT_CONFIG_ERROR, "error"
    )
    assert message in line


# --------------------------------------------------------------------------------------------
# The run dir itself on a full disk: its log file, result.json
# --------------------------------------------------------------------------------------------

FILLING_HOOK = """\
import contextlib

from trainers import Hook


class FillDisk(Hook):
    \"\"\"Fills the filesystem of `path` after step `at_step`, as another writer would.\"\"\"

    def __init__(self, path: str, at_step: int):
        self.path, self.at_step = path, at_step

    def on_step(self, step, metrics):
        if step == self.at_step:
            with contextlib.suppress(OSError), open(self.path, "wb", buffering=0) as f:
                while True:
                    f.write(b"\\0" * 4096)
"""


def test_a_run_dir_that_fills_up_ends_in_a_few_lines_and_says_what_of_result_json(tmp_path):
    (tmp_path / "xs_fill_disk.py").write_text(FILLING_HOOK)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getenv("PYTHONPATH")]))}
    mnt = tmp_path / "mnt"
    run = mnt / "run"
    overrides = ["trainer.steps=8", "checkpoint.every_steps=2"]
    with tmpfs(mnt, 1024 * 1024):  # room for the start-up checks and one checkpoint
        filling = [
            "+allowed_targets=[xs_fill_disk.]",
            f"trainer.hooks=[{{_target_:xs_fill_disk.FillDisk,path:{mnt / 'fill'},at_step:3}}]",
        ]
        result = cli(run, *overrides, *filling, env=env)
        output = result.stdout[-3000:] + result.stderr[-3000:]
        assert result.returncode == EXIT_CONFIG_ERROR, output
        assert "Traceback" not in result.stdout + result.stderr, output
        assert "Logging error" not in result.stdout + result.stderr, output
        lines = result.stderr.strip().splitlines()
        assert len(lines) <= 3, output  # the log file's line, result.json's, the error
        assert lines[-1].startswith("xshard: error: ") and "No space left on device" in lines[-1]
        # The log file says once that it cannot be written, or, where every record after the
        # fill still fit in its last page (tmpfs allocates by page; an early save that fails
        # first ends the run after few records), holds the run's last record.
        log_line = f"xshard: warning: the log file {run / 'train.log'} cannot be written"
        if sum(line.startswith(log_line) for line in lines) != 1:
            assert not any(line.startswith(log_line) for line in lines), output
            assert "Run failed at step" in (run / "train.log").read_text(), output
        if (run / "result.json").exists():
            assert json.loads((run / "result.json").read_text())["status"] == "failed"
        else:  # its absence explained, in one line
            assert any("result.json could not be written" in line for line in lines[:-1]), output
        assert not list(run.glob("*.tmp")), sorted(p.name for p in run.iterdir())

        # Space freed: the same command trains to the end and writes its result.json.
        (mnt / "fill").unlink()
        rerun = cli(run, *overrides, env=env)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert rerun.stderr.strip() == "", rerun.stderr[-3000:]
        assert json.loads((run / "result.json").read_text())["status"] == "completed"
        assert complete_steps(run / "checkpoints")[-1] == 8


def filling_hook(tmp_path: Path, mnt: Path, at_step: int) -> tuple[list[str], dict[str, str]]:
    """Overrides and environment of a run whose `FILLING_HOOK` fills `mnt` after `at_step`."""
    (tmp_path / "xs_fill_disk.py").write_text(FILLING_HOOK)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.getenv("PYTHONPATH")]))}
    overrides = [
        "+allowed_targets=[xs_fill_disk.]",
        f"trainer.hooks=[{{_target_:xs_fill_disk.FillDisk,path:{mnt / 'fill'},at_step:{at_step}}}]",
    ]
    return overrides, env


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_csv_file_on_a_disk_that_fills_up_is_handled_like_tensorboard(tmp_path, on_error):
    """The CSV logger's flush on a full disk: one line and exit 2 after a clean stop (with its
    checkpoint), or one warning and the run trains to the end; the rows before stay valid."""
    run, mnt = tmp_path / "run", tmp_path / "mnt"
    filling, env = filling_hook(tmp_path, mnt, 3)
    csv_path = mnt / "metrics.csv"
    overrides = [
        "trainer.steps=200",
        "checkpoint.every_steps=0",
        "logger=[tensorboard,csv]",
        f"logger.csv.path={csv_path}",
        f"logger.on_error={on_error}",
    ]
    with tmpfs(mnt, 256 * 1024):
        result = cli(run, *overrides, *filling, env=env)
        rows = csv_path.read_text().splitlines()
    assert rows[0] == "step,name,value"
    steps = [int(r.split(",")[0]) for r in rows[1:] if r.count(",") == 2 and r[0].isdigit()]
    assert {1, 2, 3} <= set(steps)  # written before the disk filled up
    if on_error == "stop":
        line = assert_one_line_error(result, EXIT_CONFIG_ERROR, "error")
        when = re.search(r"The run stopped cleanly at step (\d+)", line)
        assert f"logger=csv cannot write to logger.csv.path='{csv_path}'" in line, line
        assert "No space left on device" in line and "logger.on_error=continue" in line
        assert when is not None and 3 < int(when[1]) < 200, line
        assert complete_steps(run / "checkpoints") == [int(when[1])]  # saved where it stopped
        assert load_state(run / "checkpoints" / when[1])["['step']"] == int(when[1])
    else:
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stdout + result.stderr
        assert result.stdout.count("training continues without it") == 1
        assert complete_steps(run / "checkpoints") == [200]


def test_csv_config_files_on_a_full_disk_stop_before_training_and_leave_no_temp_file(tmp_path):
    run, mnt = tmp_path / "run", tmp_path / "mnt"
    with tmpfs(mnt, 64 * 1024):
        csv_path = mnt / "metrics.csv"
        csv_path.write_text("step,name,value\n")  # appended to: room left in its page
        fill(mnt)
        result = cli(
            run, "trainer.steps=4", "logger=[tensorboard,csv]", f"logger.csv.path={csv_path}"
        )
        line = assert_one_line_error(result, EXIT_CONFIG_ERROR, "error")
        assert f"logger=csv cannot write to logger.csv.path='{csv_path}'" in line
        assert "No space left on device. The run stopped cleanly before training" in line
        assert sorted(p.name for p in mnt.iterdir()) == ["fill", "metrics.csv"]
        assert csv_path.read_text() == "step,name,value\n"
    assert complete_steps(run / "checkpoints") == []


def test_a_full_run_dir_is_refused_in_one_line_before_hydra_writes_there(tmp_path):
    mnt = tmp_path / "mnt"
    with tmpfs(mnt, 64 * 1024):
        fill(mnt)
        line = assert_one_line_error(
            cli(mnt / "run", "trainer.steps=4"), EXIT_CONFIG_ERROR, "error"
        )
        assert f"hydra.run.dir='{mnt / 'run'}' has too little free space" in line
        assert "config dump (.hydra/), log file and result.json" in line
        assert [p.name for p in (mnt / "run").iterdir()] == []


def test_result_json_on_a_full_disk_replaces_an_earlier_one_or_is_absent_without_a_temp_file(
    tmp_path,
):
    with tmpfs(tmp_path / "mnt", 64 * 1024) as mnt:
        write_result(mnt, {"status": "completed", "run": 1})
        fill(mnt)
        # The earlier run's file is no outcome of this one: removed, and its space reused.
        write_result(mnt, {"status": "failed", "run": 2})
        assert json.loads((mnt / "result.json").read_text())["run"] == 2
        (mnt / "result.json").unlink()
        fill(mnt)
        with pytest.raises(OSError, match="No space left"):
            write_result(mnt, {"status": "failed", "run": 3})
        assert sorted(p.name for p in mnt.iterdir()) == ["fill"]  # no result.json, no temp file


def test_the_log_file_on_a_full_disk_says_so_once_and_stops(tmp_path, capfd):
    with tmpfs(tmp_path / "mnt", 64 * 1024) as mnt:
        fill(mnt)
        handler = RunLogFile(mnt / "train.log")
        logger = logging.getLogger("test_io_faults_cli.full_log")
        logger.addHandler(handler)
        try:
            for i in range(50):
                logger.warning("record %d", i)
        finally:
            logger.removeHandler(handler)
            handler.close()
        err = capfd.readouterr().err.strip().splitlines()
        assert handler.problem == "No space left on device"
        assert err == [
            (
                f"xshard: warning: the log file {mnt / 'train.log'} cannot be written (No space "
                "left on device); the run goes on, logging to the console only."
            )
        ]
