"""The Trainer's parts, each built and used alone: the placement of the arrays, the step
programs; and `fit`'s result record."""

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh

import xshard
from trainers.core.placement import DevicePlacement
from trainers.core.precision import Precision
from trainers.core.step.compiled import ProgramKey
from trainers.core.step.levels import PLAIN, STATS
from trainers.core.step.programs import StepPrograms, step_functions
from trainers.core.step.step_spec import step_spec
from trainers.core.trainer import Hook, Trainer
from trainers.core.zero import zero_layout
from trainers.tasks.mlp import MLPTask

BATCH = 32
MESH = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))


def test_a_placement_and_step_programs_built_alone_take_the_trainers_first_step():
    task = MLPTask()
    tx = xshard.cross_shard(optax.sgd(1e-2), "mean")
    batch = next(iter(task.batches(BATCH, seed=0)))
    layout = zero_layout(0, MESH, ("data",), lambda: task.sharding_rules)
    placement = DevicePlacement(
        task, tx, MESH, data_axes=("data",), seed=0, layout=layout, precision=Precision()
    )
    spec = step_spec(
        MESH,
        ("data",),
        ("data",),
        None,
        global_batch_size=BATCH,
        microbatches=1,
        grad_impl="manual",
        seed=0,
    )
    programs = StepPrograms(
        step_functions(task, tx, MESH, spec, layout, Precision()),
        {},
        mesh=MESH,
        batch_sharding=placement.batch_sharding,
        periodic=None,
        agree_stop=False,
        grad_impl="manual",
    )
    state = placement.init(placement.init_params(batch))
    state, metrics = programs.run(ProgramKey(PLAIN), state, placement.as_global(batch), 0)
    assert int(state.step) == 1 and list(programs.compiled.by_level()) == [PLAIN]
    assert programs.compile_seconds is not None and programs.compile_seconds > 0

    trainer = Trainer(task, tx, MESH, global_batch_size=BATCH)
    first = trainer.init(trainer.init_params(batch))
    theirs, their_metrics = trainer.step(first, batch, with_stats=False)
    assert metrics["train/loss"] == their_metrics["train/loss"]
    for ours, other in zip(jax.tree.leaves(state.params), jax.tree.leaves(theirs.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(other))


class Compiles(Hook):
    def __init__(self):
        self.reported = {}

    def on_step(self, step, metrics):
        if "perf/compile_time_s" in metrics:
            self.reported[step] = metrics["perf/compile_time_s"]


def test_fit_returns_its_result_and_reports_the_compile_time_once():
    task = MLPTask()
    trainer = Trainer(task, optax.sgd(1e-2), MESH, global_batch_size=BATCH)
    state = trainer.init(trainer.init_params(next(iter(task.batches(BATCH, seed=0)))))
    hook = Compiles()
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=3, hooks=[hook])
    assert (result.reason, int(result.state.step), result.agreed_stop) == ("done", 3, None)
    assert result.compile_seconds == trainer.compile_seconds == hook.reported[1]
    assert list(hook.reported) == [1] and sorted(trainer.executables()) == [STATS]
    again = trainer.fit(result.state, task.batches(BATCH, seed=3), num_steps=5, hooks=[hook])
    assert again.compile_seconds == result.compile_seconds and list(hook.reported) == [1]
    # Programs compiled before a fit (an elastic group's, before it joins its peers): its
    # first step reports them.
    ahead = Trainer(task, optax.sgd(1e-2), MESH, global_batch_size=BATCH)
    first = next(iter(task.batches(BATCH, seed=0)))
    state = ahead.init(ahead.init_params(first))  # the first fit donated its state
    periods = {"stats_every": 1, "layer_stats_every": 0, "histogram_every": 0}
    ahead.compile_run(state, first, 1, 3, periods)
    hook = Compiles()
    ahead.fit(state, task.batches(BATCH, seed=0), num_steps=3, hooks=[hook])
    assert hook.reported == {1: ahead.compile_seconds} and ahead.compile_seconds > 0
