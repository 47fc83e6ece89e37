"""Every bad value of the run's own keys is one clear error (exit 2), never a traceback.

The cases come from an adversarial audit: each of these used to crash with a traceback
(exit 1), allocate terabytes, or be accepted although meaningless. In-process through Hydra's
compose API for the message; through the real CLI for the exit status and the one line.
"""

from __future__ import annotations

import pytest
from cli import run_train

from trainers.train import train
from xshard.config import TrainerOptions, read_node
from xshard.errors import ConfigError

LONG = "x" * 5000


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["seed=abc"], "seed='abc': expected an integer, 0 <= seed <= 4294967295"),
        (["seed=-1"], "seed=-1: expected an integer"),
        (["seed=1.5"], "seed=1.5: expected an integer"),
        (["seed=100000000000000000000000"], "seed=100000000000000000000000: expected"),
        (["trainer.batch_size=1000000000000"], "trainer.batch_size=1000000000000 needs 72.8 TiB"),
        (["trainer.batch_size=0"], "trainer.batch_size=0: expected an integer, the global batch"),
        (["trainer.microbatches=abc"], "trainer.microbatches='abc': expected an integer"),
        (["trainer.layer_stats_every=abc"], "trainer.layer_stats_every='abc': expected an int"),
        (["trainer.resume_from=[a,b]"], "trainer.resume_from=['a', 'b']: expected a string"),
        (["trainer.log_every=0"], "trainer.log_every=0: expected an integer, a period in steps"),
        (["trainer.log_every=-1"], "trainer.log_every=-1: expected an integer"),
        (["trainer.stats_every=-1"], "trainer.stats_every=-1: expected an integer"),
        (["trainer.histogram_every=-5"], "trainer.histogram_every=-5: expected an integer"),
        (["trainer.max_consecutive_nonfinite=-1"], "trainer.max_consecutive_nonfinite=-1: exp"),
        (["trainer.progress=maybe"], "trainer.progress='maybe': expected true or false"),
        (["+trainer.bogus=1"], "trainer.bogus: unknown key. Allowed keys: ['steps'"),
        (["task.hidden=[-4]"], "task.hidden=[-4]: expected a list of integers >= 1"),
        (["task.hidden=4"], "task.hidden=4: expected a list of integers >= 1"),
        (["task.in_dim=-3"], "task.in_dim=-3: expected an integer >= 1"),
        (["checkpoint.replica_parallel=maybe"], "checkpoint.replica_parallel='maybe': expected"),
        (["paths.checkpoint_dir=''"], "paths.checkpoint_dir='': expected a directory path"),
        (["paths.tb_dir=[a]"], "paths.tb_dir=['a']: expected a string"),
        (["distributed.enabled=maybe"], "distributed.enabled='maybe': expected true or false"),
        (["distributed.num_processes=0"], "distributed.num_processes=0: expected an integer"),
        (["distributed.cpu_collectives=tcp"], "distributed.cpu_collectives='tcp': choose one"),
        (["distributed.coordinator_address=nohost"], "distributed.coordinator_address='nohost'"),
        (
            ["distributed.num_processes=2", "distributed.process_id=2"],
            "distributed.process_id=2: expected an integer, 0 <= process_id < num_processes",
        ),
        (
            ["schedule=constant", "schedule._target_=optax.adam"],
            "schedule._target_='optax.adam' did not build a schedule (step -> learning rate)",
        ),
        (
            ["trainer.grad_impl=gspmd", "reduction=mean_clipped"],
            "trainer.grad_impl='gspmd' computes no per-shard gradients, but the optimizer",
        ),
    ],
)
def test_bad_value_is_a_config_error_naming_key_and_value(compose_config, overrides, message):
    with pytest.raises(ConfigError) as err:
        train(compose_config(*overrides))
    assert message in str(err.value)


def test_long_values_are_elided_in_messages():
    base = {f: 1 for f in ("steps", "batch_size", "microbatches", "log_every", "stats_every")}
    base |= dict(
        layer_stats_every=0,
        histogram_every=0,
        max_consecutive_nonfinite=0,
        resume_from=None,
        progress=False,
        failed_objective=None,
        profile_steps=None,
        hooks=[],
    )
    with pytest.raises(ConfigError) as err:
        read_node(TrainerOptions, {**base, "grad_impl": LONG}, "trainer")
    assert "(5002 characters)" in str(err.value) and len(str(err.value)) < 300


def test_typed_node_reads_valid_values(compose_config):
    cfg = compose_config("trainer.microbatches=2", "trainer.resume_from=null")
    opts = read_node(TrainerOptions, cfg.trainer, "trainer")
    assert opts.microbatches == 2 and opts.resume_from is None
    assert opts.stats_every == opts.log_every  # the interpolation is resolved


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["seed=abc"], "seed='abc'"),
        (["trainer.microbatches=abc"], "trainer.microbatches='abc'"),
        (["paths.checkpoint_dir=' '"], "paths.checkpoint_dir=' ': expected a directory path"),
        ([f"trainer.grad_impl={LONG}"], "(5002 characters) is not allowed"),
        (["distributed.enabled=true"], "distributed.enabled=true: JAX could not set up"),
        (["trainer.grad_impl=gspmd", "reduction=mean_clipped"], "trainer.grad_impl='gspmd'"),
    ],
)
def test_cli_bad_value_exits_2_with_one_line(tmp_path, overrides, message):
    proc = run_train(
        "task=mlp", "checkpoint=none", "trainer.steps=2", *overrides, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    assert message in lines[0] and len(lines[0]) < 600
