"""I/O faults in-process: recognising failed writes, free-space checks, a TensorBoard event
file that cannot be flushed, stop requests before the first step, hooks that fail in `on_end`.
End-to-end runs on a full disk are in test_io_faults_cli.py."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import sys
import time

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts
from jax.sharding import AxisType, Mesh

import xshard
from tests.cli import load_events, scalars
from trainers.checkpoint.io import (
    IOErrorsInOneLine,
    checkpoint_bytes,
    complete_steps,
    quiet_io_error_noise,
    write_failure,
)
from trainers.checkpoint.save import CheckpointHook
from trainers.config import CheckpointOptions, LoggerOptions
from trainers.core.trainer import Hook, Trainer
from trainers.exits import LoggerError
from trainers.hooks.log_sink import RunInfo
from trainers.hooks.logged_scalars import LoggedScalars, ScalarOptions
from trainers.hooks.run_logger import LoggerHook
from trainers.hooks.summary import RunSummary
from trainers.hooks.tensorboard import TensorBoardSink
from trainers.rundir.disk import check_free_space
from trainers.tasks.mlp import MLPTask
from xshard.errors import ConfigError

# --------------------------------------------------------------------------------------------
# Failed writes and free space
# --------------------------------------------------------------------------------------------

TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "/c/20.'
    'orbax-checkpoint-tmp/state/": Failed to write 943 bytes to file 12: No space left on '
    "device [os_error_code='28']"
)


def test_write_failure_reads_os_errors_through_the_exception_chain():
    assert write_failure(OSError(28, "No space left on device")) == "No space left on device"
    assert write_failure(ValueError(TENSORSTORE_ENOSPC)) == "No space left on device"
    try:
        try:
            raise PermissionError(13, "Permission denied")
        except PermissionError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as wrapped:
        assert write_failure(wrapped) == "Permission denied"
    assert write_failure(ValueError("Expected args of type Composite")) is None


def test_checkpoint_bytes_counts_the_arrays_and_a_margin():
    state = {"w": np.zeros((1000, 100), np.float32), "step": np.int32(3)}
    data = 400_000 + 4
    assert data < checkpoint_bytes(state) < data * 1.1 + 200_000


def test_free_space_check_names_key_and_bytes_and_counts_reclaimable_space(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_free_space(tmp_path, 1 << 60, "paths.checkpoint_dir", what="one checkpoint")
    message = str(err.value)
    assert f"paths.checkpoint_dir='{tmp_path}' has too little free space for one checkpoint" in (
        message
    )
    assert f"needs about {1 << 60:,} bytes" in message and "bytes free" in message
    check_free_space(tmp_path, 1 << 60, "k", what="x", reclaimable=1 << 60)  # no error


def test_tensorstore_callbacks_into_a_closed_loop_are_dropped_and_other_errors_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    quiet_io_error_noise()
    # What Orbax leaves behind after a failed write: a tensorstore future whose callback is
    # the `call_soon_threadsafe` of an asyncio loop that has closed meanwhile.
    loop = asyncio.new_event_loop()
    loop.close()
    promise, future = ts.Promise.new()
    future.add_done_callback(functools.partial(loop.call_soon_threadsafe, print))

    def other_error(_):
        raise ValueError("not noise")

    future.add_done_callback(other_error)
    promise.set_result(1)
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["not noise"]


def test_logged_io_errors_lose_their_traceback_others_keep_it():
    def record(error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except type(error):
            r = logging.LogRecord(
                "absl", logging.ERROR, "f", 1, "Save failed.", None, sys.exc_info()
            )
        IOErrorsInOneLine().filter(r)
        return r

    io = record(ValueError(TENSORSTORE_ENOSPC))
    assert io.exc_info is None and io.getMessage().startswith("Save failed. (ValueError: RESOURCE")
    other = record(KeyError("bug"))
    assert other.exc_info is not None and other.getMessage() == "Save failed."


# --------------------------------------------------------------------------------------------
# The logger node and a failing TensorBoard event file
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node, message",
    [
        ({"flush_secs": "abc"}, "logger.flush_secs='abc': expected a number"),
        ({"flush_secs": float("inf")}, "logger.flush_secs=inf"),
        ({"flush_secs": True}, "logger.flush_secs=True"),
        ({"on_error": "retry"}, "logger.on_error='retry': expected one of ['stop', 'continue']"),
        ({"bogus": 1}, "logger.bogus: unknown key. Allowed keys: ['flush_secs', 'on_error', "),
    ],
)
def test_logger_options_are_validated(node, message):
    with pytest.raises(ConfigError) as err:
        LoggerOptions.from_config(node)
    assert message in str(err.value)
    assert LoggerOptions.from_config({"flush_secs": 0.5}).flush_secs == 0.5


def tensorboard_hook(logdir, on_error: str = "stop", flush_secs: float = 1) -> LoggerHook:
    """A logging hook writing every step to TensorBoard only."""
    scalars = LoggedScalars(ScalarOptions(log_every=1, num_steps=1000, global_batch_size=8))
    sinks = [TensorBoardSink(str(logdir), flush_secs=flush_secs)]
    return LoggerHook(sinks, RunInfo(), scalars, RunSummary(), on_error=on_error)


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_failed_flush_is_reported_once_in_the_calling_thread_and_never_blocks(
    tmp_path, monkeypatch, caplog, capfd, on_error
):
    hook = tensorboard_hook(tmp_path, on_error, flush_secs=1e-3)

    def no_space(fd: int) -> None:  # the flush's sync, on a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 1001):
            hook.on_step(step, {"train/loss": 1.0})
    assert hook.wants_stop() == (on_error == "stop")
    reported = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(reported) == 1 and "(No space left on device)" in reported[0], reported
    if on_error == "stop":
        with pytest.raises(LoggerError, match=r"paths.tb_dir=.*No space left on device\. The run"):
            hook.on_end(1000, None, "stopped")
    else:
        hook.on_end(1000, None, "done")
        assert "training continues without them" in reported[0]
    assert "Traceback" not in capfd.readouterr().err


def test_a_working_sink_writes_events(tmp_path):
    hook = tensorboard_hook(tmp_path)
    for step in range(1, 31):
        hook.on_step(step, {"x": float(step)})
    hook.on_end(30, None, "done")
    assert not hook.wants_stop()
    assert scalars(tmp_path, "x") == {s: float(s) for s in range(1, 31)}


def test_scalars_written_as_one_event_read_back_as_add_scalar_writes_them(tmp_path):
    from tensorboardX import SummaryWriter

    one, many = tmp_path / "one", tmp_path / "many"
    values = [("a/x", 1.5), ("/b y", 2), ("c", float("nan"))]  # a tag to clean, an int, NaN
    writer = SummaryWriter(str(one))
    for tag, value in values:
        writer.add_scalar(tag, value, 7)
    writer.close()
    sink = TensorBoardSink(str(many), flush_secs=1)
    sink.start(RunInfo())
    sink.log_scalars(7, dict(values))
    sink.log_scalars(8, {})  # nothing to write: no event
    sink.finish({}, True)
    assert set(load_events(many).Tags()["scalars"]) == {"a/x", "b_y", "c"}
    for tag in ("a/x", "b_y", "c"):
        expected = scalars(one, tag)
        assert scalars(many, tag).keys() == expected.keys() == {7}
        np.testing.assert_equal(scalars(many, tag)[7], expected[7])


# --------------------------------------------------------------------------------------------
# Stopping before the first step; failing on_end
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_and_state():
    task = MLPTask()
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
    tx = xshard.cross_shard(optax.adam(1e-3), "mean", skip_nonfinite=True)
    trainer = Trainer(task, tx, mesh, global_batch_size=16)
    first = next(iter(task.batches(16, seed=0)))
    return trainer, lambda: trainer.init(trainer.init_params(first)), task


class Recorder(Hook):
    def __init__(self, fail_on_end: bool = False):
        self.steps: list[int] = []
        self.ends: list[str] = []
        self.fail_on_end = fail_on_end

    def on_step(self, step, metrics):
        self.steps.append(step)

    def on_end(self, step, state, reason):
        self.ends.append(reason)
        if self.fail_on_end:
            raise OSError(28, "No space left on device")


class StopNow(Hook):
    def wants_stop(self) -> bool:
        return True


@pytest.mark.parametrize("via", ["should_stop", "hook"])
def test_a_stop_requested_before_the_first_step_trains_and_writes_nothing(
    trainer_and_state, tmp_path, via
):
    trainer, init, task = trainer_and_state
    rec = Recorder()
    ckpt = CheckpointHook(tmp_path, CheckpointOptions(every_steps=1, async_save=False), {})
    hooks = [rec, ckpt] if via == "should_stop" else [StopNow(), rec, ckpt]
    result = trainer.fit(
        init(),
        task.batches(16, seed=0),
        num_steps=5,
        hooks=hooks,
        should_stop=(lambda: True) if via == "should_stop" else (lambda: False),
    )
    state, reason = result.state, result.reason
    assert reason == "stopped" and int(state.step) == 0
    assert rec.steps == [] and rec.ends == ["stopped"]
    assert complete_steps(tmp_path) == []


def test_a_hook_failing_in_on_end_does_not_stop_the_checkpoint_hook(trainer_and_state, tmp_path):
    trainer, init, task = trainer_and_state
    first, second = Recorder(fail_on_end=True), Recorder(fail_on_end=True)
    ckpt = CheckpointHook(tmp_path, CheckpointOptions(every_steps=0, async_save=False), {})
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(init(), task.batches(16, seed=0), num_steps=3, hooks=[first, second, ckpt])
    assert first.ends == second.ends == ["done"]
    assert complete_steps(tmp_path) == [3]  # the hook after the failing ones still saved
