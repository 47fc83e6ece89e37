"""Every bad value of the run's own keys is one clear error (exit 2), never a traceback.

The cases come from adversarial audits: each of these used to crash with a traceback
(exit 1), allocate terabytes, be accepted although meaningless (optimizer.b1=2,
task.noise_std=-1, mesh.axes=[], schedule.end_factor=nan, optimizer.mu_dtype=int8,
trainer.steps=2**31), or name neither key nor value. In-process through Hydra's compose API
for the message (every optimizer and schedule rule on every schema: tests/config/
test_argument_rules.py); through the real CLI for the exit status and the one line; and the
doctor, which must refuse what the run refuses.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli import run_train
from trainers.app.cli_overrides import group_override_error, removed_key_error
from trainers.config import TrainerOptions
from trainers.train import train
from xshard.config import read_node
from xshard.errors import ConfigError
from xshard.mesh.spec import mesh_spec

LONG = "x" * 5000
#: A periodic axis: DiLoCo over the slices of 8 CPU devices.
DILOCO = ["reduction=diloco", "mesh=cpu2x4_slices"]
#: What Streaming DiLoCo's delay and mixing may be (the preset's every_steps is 8).
DELAY_RANGE = (
    "expected the inner steps between a fragment's send and its outer update (< every_steps), "
    "an integer with 0 <= sync_delay < 8."
)
MIX_RANGE = (
    "expected the share of the replica's own params kept at a sync, a finite number with "
    "0 <= mix <= 1."
)


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
        (
            ["trainer.profile_steps=[a,b]"],
            "trainer.profile_steps=['a', 'b']: expected an integer at trainer.profile_steps[0]",
        ),
        (["optimizer=adam", "optimizer.b1=2"], "optimizer.b1=2.0: expected an exponential decay"),
        (["optimizer=lion", "optimizer.b2=1"], "optimizer.b2=1.0: expected an exponential decay"),
        (["optimizer.eps=-1"], "optimizer.eps=-1.0: expected a constant added for numerical"),
        (["optimizer=rmsprop", "optimizer.decay=1.5"], "optimizer.decay=1.5: expected an exp"),
        (["optimizer=momentum", "optimizer.momentum=1"], "optimizer.momentum=1.0: expected an"),
        (["optimizer.weight_decay=-1"], "optimizer.weight_decay=-1.0: expected the weight-decay"),
        (["task.noise_std=-1"], "task.noise_std=-1: expected a finite number >= 0"),
        (["task.teacher_seed=-1"], "task.teacher_seed=-1: expected an integer, 0 <= task.teach"),
        (["mesh.axes=[]"], "mesh.axes=[]: expected a non-empty list of axis names"),
        (["mesh.data_axes=[]"], "mesh.data_axes=[]: expected a non-empty list of axis names"),
        # Schedules: factors finite and in range, step counts bounded by the int32 counter.
        (["schedule=cosine", "schedule.end_factor=nan"], "schedule.end_factor=nan: expected the"),
        (["schedule=warmup_linear", "schedule.end_factor=inf"], "schedule.end_factor=inf: exp"),
        (["schedule.init_factor=-5"], "schedule.init_factor=-5: expected the first rate"),
        (["schedule.init_factor=2"], "schedule.init_factor=2: expected the first rate of the"),
        (["schedule=cosine", "schedule.exponent=0"], "schedule.exponent=0: expected the exp"),
        (["schedule.exponent=-1"], "schedule.exponent=-1: expected the exponent of the cosine"),
        (["schedule=exponential", "schedule.decay_rate=0"], "schedule.decay_rate=0: expected"),
        (["schedule=exponential", "schedule.transition_steps=0"], "schedule.transition_steps=0"),
        (
            ["schedule.warmup_steps=3000000000"],
            "schedule.warmup_steps=3000000000: expected steps of linear warmup (0: none), an "
            "integer with 0 <= warmup_steps <= 2147483647",
        ),
        (["schedule.decay_steps=2147483648"], "schedule.decay_steps=2147483648: expected the"),
        # Optimizer: dtypes are floating, the learning rate finite (the outer one too).
        (
            ["optimizer=adam", "optimizer.mu_dtype=int8"],
            "optimizer.mu_dtype='int8': expected the dtype of the first moment, one of "
            "['bfloat16', 'float16', 'float32', 'float64'], or null",
        ),
        (["optimizer=adam", "optimizer.mu_dtype=foo"], "optimizer.mu_dtype='foo': expected the"),
        (["optimizer=lion", "optimizer.mu_dtype=int32"], "optimizer.mu_dtype='int32': expected"),
        (["optimizer=sgd", "optimizer.accumulator_dtype=int8"], "optimizer.accumulator_dtype='"),
        (["optimizer=adafactor", "optimizer.dtype_momentum=int8"], "optimizer.dtype_momentum='"),
        (["optimizer.learning_rate=nan"], "optimizer.learning_rate=nan: expected the base (peak)"),
        (["optimizer.learning_rate=inf"], "optimizer.learning_rate=inf: expected the base (peak)"),
        (
            [*DILOCO, "reduction.axes.slice.outer_optimizer.learning_rate=nan"],
            "reduction.axes.slice.outer_optimizer.learning_rate=nan: expected the base (peak) "
            "learning rate, a finite number > 0.",
        ),
        (
            [*DILOCO, "reduction.axes.slice.outer_optimizer.learning_rate=-5"],
            "reduction.axes.slice.outer_optimizer.learning_rate=-5: expected the base (peak)",
        ),
        (
            [*DILOCO, "reduction.axes.slice.outer_optimizer.momentum=inf"],
            "reduction.axes.slice.outer_optimizer.momentum=inf: expected an exponential decay",
        ),
        (["reduction.clip_per_shard=inf"], "reduction.clip_per_shard=inf: expected a global"),
        # Steps, periods and step counts past the int32 step counter.
        (
            [*DILOCO, "reduction.axes.slice.every_steps=3000000000"],
            "reduction.axes.slice.every_steps=3000000000: expected the steps between syncs (1: "
            "every step), an integer with 1 <= every_steps <= 2147483647 (2**31 - 1, an int32)",
        ),
        (
            [*DILOCO, "reduction.axes.slice.warmup_steps=3000000000"],
            "reduction.axes.slice.warmup_steps=3000000000: expected the synchronous steps",
        ),
        # Streaming DiLoCo: 0 <= sync_delay < every_steps (8 in the preset), 0 <= mix <= 1.
        (
            [*DILOCO, "reduction.axes.slice.sync_delay=-1"],
            "reduction.axes.slice.sync_delay=-1: " + DELAY_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.sync_delay=8"],
            "reduction.axes.slice.sync_delay=8: " + DELAY_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.sync_delay=1.5"],
            "reduction.axes.slice.sync_delay=1.5: " + DELAY_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.sync_delay=abc"],
            "reduction.axes.slice.sync_delay='abc': " + DELAY_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.mix=-0.1"],
            "reduction.axes.slice.mix=-0.1: " + MIX_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.mix=1.5"],
            "reduction.axes.slice.mix=1.5: " + MIX_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.mix=nan"],
            "reduction.axes.slice.mix=nan: " + MIX_RANGE,
        ),
        (
            [*DILOCO, "reduction.axes.slice.mix=abc"],
            "reduction.axes.slice.mix='abc': " + MIX_RANGE,
        ),
        (
            ["trainer.steps=2147483648"],
            "trainer.steps=2147483648: expected an integer, the number of updates, >= 1, at most "
            "2147483647 (2**31 - 1, an int32).",
        ),
        (["trainer.log_every=3000000000"], "trainer.log_every=3000000000: expected an integer"),
        (["trainer.eval_every=3000000000"], "trainer.eval_every=3000000000: expected an integer"),
        (["checkpoint.every_steps=3000000000"], "checkpoint.every_steps=3000000000: expected"),
        (
            ["trainer.steps=10", "trainer.profile_steps=[9,11]"],
            "trainer.profile_steps=[9, 11]: expected [first, last], integers with 1 <= first <= "
            "last <= trainer.steps=10 (the steps to trace), or null.",
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


def test_null_switches_a_period_off_as_0_does(compose_config):
    """``trainer.layer_stats_every=null`` (and the other periods that 0 switches off) is
    read as 0, as users write it; ``stats_every=null`` keeps its meaning (every log_every)."""
    off = ("trainer.layer_stats_every=null", "trainer.histogram_every=null")
    cfg = compose_config(*off, "trainer.eval_every=null", "trainer.stats_every=null")
    opts = read_node(TrainerOptions, cfg.trainer, "trainer")
    assert (opts.layer_stats_every, opts.histogram_every, opts.eval_every) == (0, 0, 0)
    assert opts.stats_every == opts.log_every
    with pytest.raises(ConfigError, match=r"^trainer.log_every=None: expected a value, not null"):
        read_node(TrainerOptions, compose_config("trainer.log_every=null").trainer, "trainer")


def test_empty_mesh_axes_are_refused_and_null_is_the_default():
    assert mesh_spec({"axes": None, "data_axes": None}) == mesh_spec({})
    for key in ("axes", "data_axes", "axis_types"):
        with pytest.raises(ConfigError, match=rf"^mesh\.{key}="):
            mesh_spec({key: []})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["schedule=null"], "schedule=null: expected the name of an option of the 'schedule'"),
        (["+schedule=null"], "schedule=null: expected the name of an option"),
        (["-m", "schedule=cosine,null"], "schedule=null: expected the name of an option"),
        (["optimizer=1"], "optimizer=1: expected the name of an option of the 'optimizer'"),
        (["hydra/launcher=null"], "hydra/launcher=null: expected the name of an option"),
        (["seed=5", "clip=null", "~schedule", "schedule=cosine", "optimizer=glob(*)"], None),
    ],
)
def test_group_override_without_an_option_name(overrides, message):
    error = group_override_error(overrides)
    if message is None:
        assert error is None
        return
    assert isinstance(error, ConfigError) and str(error).startswith(message)
    if "schedule" in message:
        assert "['constant', 'cosine', 'exponential', 'warmup_cosine', 'warmup_linear']" in str(
            error
        )


@pytest.mark.parametrize("value", ["one", "two", "per_level"])
def test_a_removed_key_is_refused_naming_it_and_saying_it_was_removed(value, compose_config):
    for arg in (f"trainer.step_executables={value}", f"+trainer.step_executables={value}"):
        error = removed_key_error(["task=mlp", arg])
        assert isinstance(error, ConfigError)
        message = str(error)
        assert message.startswith(f"trainer.step_executables={value}: this key was removed")
        assert "own compiled program" in message and "Delete the override" in message
    assert removed_key_error(["task=mlp", "trainer.steps=3", "--cfg", "job"]) is None
    with pytest.raises(Exception, match="step_executables"):  # composed without the CLI
        compose_config("trainer.step_executables=one")


# --------------------------------------------------------------------------------------------
# Through the real CLI: exit 2, one line naming the key and the value, no traceback
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["seed=abc"], "seed='abc'"),
        (["trainer.microbatches=abc"], "trainer.microbatches='abc'"),
        # Hydra's own override errors (a typed key, an unknown key): trainers.app.override_errors
        (["reduction.skip_nonfinite=maybe"], "reduction.skip_nonfinite=maybe: Value 'maybe' is"),
        (["optimizer.lr=0.1"], "optimizer.lr=0.1: unknown key. Allowed keys: ['_target_',"),
        (["paths.checkpoint_dir=' '"], "paths.checkpoint_dir=' ': expected a directory path"),
        ([f"trainer.grad_impl={LONG}"], "(5002 characters) is not allowed"),
        (["distributed.enabled=true"], "distributed.enabled=true: JAX could not set up"),
        (["trainer.grad_impl=gspmd", "reduction=mean_clipped"], "trainer.grad_impl='gspmd'"),
        (["optimizer=adam", "optimizer.b1=2"], "optimizer.b1=2.0: expected an exponential decay"),
        (["optimizer.eps=-1"], "optimizer.eps=-1.0: expected a constant added for numerical"),
        (["optimizer.weight_decay=-1"], "optimizer.weight_decay=-1.0: expected the weight-decay"),
        (["task.noise_std=-1"], "task.noise_std=-1: expected a finite number >= 0"),
        (["mesh.axes=[]"], "mesh.axes=[]: expected a non-empty list of axis names"),
        (
            ["schedule=null"],
            (
                "schedule=null: expected the name of an option of the 'schedule' group, one of "
                "['constant', 'cosine', 'exponential', 'warmup_cosine', 'warmup_linear']"
            ),
        ),
        (["task.teacher_seed=-1"], "task.teacher_seed=-1: expected an integer, 0 <="),
        (["trainer.profile_steps=[a,b]"], "trainer.profile_steps=['a', 'b']: expected an int"),
        (["trainer.step_executables=one"], "trainer.step_executables=one: this key was removed"),
        (["schedule=cosine", "schedule.end_factor=nan"], "schedule.end_factor=nan: expected the"),
        (["optimizer=adam", "optimizer.mu_dtype=foo"], "optimizer.mu_dtype='foo': expected the"),
        (
            [*DILOCO, "reduction.axes.slice.outer_optimizer.learning_rate=-5"],
            "reduction.axes.slice.outer_optimizer.learning_rate=-5: expected the base (peak)",
        ),
        (["trainer.steps=2147483648"], "trainer.steps=2147483648: expected an integer, the"),
        (["trainer.profile_steps=[1,3]"], "trainer.profile_steps=[1, 3]: expected [first, last]"),
        (
            [f"+a{'b' * 10000}=1"],
            "(10001 characters)=1: a key of 10001 bytes; no config key or group is longer than "
            "250 bytes",
        ),
        (
            [f"optimizer={'x' * 300}"],
            "(300 characters): expected the name of an option of the 'optimizer' group, one of",
        ),
    ],
)
def test_cli_bad_value_exits_2_with_one_line(tmp_path, overrides, message):
    proc = run_train(
        "task=mlp", "checkpoint=none", "trainer.steps=2", *overrides, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xshard: error: "), proc.stderr[-3000:]
    assert message in lines[0] and len(lines[0]) < 600


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=abc", "seed='abc': expected an integer, 0 <= seed <= 4294967295"),
        ("+task.foo=1", "task.foo: not an argument of trainers.tasks.mlp.MLPTask"),
    ],
)
def test_doctor_refuses_what_train_refuses(tmp_path, override, message):
    """The doctor runs train's start-up checks (the same code), so it fails where train does."""
    args = ["task=mlp", override, f"hydra.run.dir={tmp_path / 'run'}"]
    doctor = subprocess.run(
        [sys.executable, "-m", "trainers.doctor", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    assert "All checks passed" not in doctor.stdout and "Traceback" not in doctor.stderr
    assert f"  - {message}" in doctor.stdout, doctor.stdout
    train_run = run_train(*args, "trainer.steps=2", cwd=tmp_path, check=False)
    assert train_run.returncode == 2 and message in train_run.stderr, train_run.stderr[-3000:]
