"""FLOPs from XLA's cost analysis, throughput and MFU scalars, tokens per example."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.cli import load_events
from trainers.hooks.logged_scalars import LoggedScalars, ScalarOptions
from trainers.hooks.perf import step_flops
from trainers.hooks.run_logger import LoggerHook, RunInfo
from trainers.hooks.summary import RunSummary
from trainers.hooks.tensorboard import TensorBoardSink
from trainers.tasks.base import tokens_per_example


def tensorboard(logdir, options: ScalarOptions) -> LoggerHook:
    """The logging hook of a run that logs to TensorBoard only."""
    sinks = [TensorBoardSink(str(logdir), flush_secs=10)]
    return LoggerHook(sinks, RunInfo(), LoggedScalars(options), RunSummary())


def test_step_flops_is_the_per_device_count_of_the_partitioned_program():
    mesh = jax.make_mesh((8,), ("d",))
    x = jax.device_put(jnp.ones((1024, 512)), NamedSharding(mesh, P("d")))
    w = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    assert step_flops(compiled) == 2 * 1024 * 512 * 256 / 8
    assert step_flops(None) is None


def test_throughput_flops_and_mfu_scalars_agree(tmp_path):
    hook = tensorboard(
        tmp_path,
        ScalarOptions(
            log_every=1,
            num_steps=3,
            global_batch_size=32,
            tokens_per_example=64,
            step_flops=lambda: 1e9,
            num_devices=8,
            peak_flops_per_device=1e12,
        ),
    )
    for step in (1, 2, 3):
        hook.on_step(step, {"train/loss": 1.0})
    hook.on_end(3, None, "done")
    events = load_events(tmp_path)
    last = {
        t: events.Scalars(t)[-1].value for t in events.Tags()["scalars"] if t.startswith("perf/")
    }
    rate = last["perf/steps_per_sec"]
    assert last["perf/examples_per_sec"] == pytest.approx(32 * rate, rel=1e-5)
    assert last["perf/tokens_per_sec"] == pytest.approx(32 * 64 * rate, rel=1e-5)
    assert last["perf/flops_per_sec"] == pytest.approx(8e9 * rate, rel=1e-5)
    assert last["perf/mfu"] == pytest.approx(1e9 * rate / 1e12, rel=1e-5)


def test_no_peak_no_mfu_and_tasks_without_tokens(tmp_path):
    options = ScalarOptions(log_every=1, num_steps=2, global_batch_size=4, step_flops=lambda: 5.0)
    hook = tensorboard(tmp_path, options)
    hook.on_step(1, {"train/loss": 1.0})
    hook.on_step(2, {"train/loss": 1.0})
    hook.on_end(2, None, "done")
    tags = set(load_events(tmp_path).Tags()["scalars"])
    assert "perf/flops_per_sec" in tags and "perf/mfu" not in tags
    assert "perf/tokens_per_sec" not in tags
    from trainers.tasks.mlp import MLPTask
    from trainers.tasks.tiny_gpt import TinyGPTTask

    assert tokens_per_example(MLPTask()) is None
    assert tokens_per_example(TinyGPTTask(seq_len=32, corpus_max_chars=20_000)) == 32
