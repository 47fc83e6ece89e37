"""A population (`trainers.core.population`): trials that differ only in their float
hyperparameters, each with its own `Trainer` in its own thread, stepping through one vmapped
program, train as each would alone, also after another trial left (docs/sweeps.md)."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from trainers.core.population import Population
from trainers.core.trainer import Trainer
from trainers.hooks.perf import run_step_flops
from trainers.tasks.mlp import MLPTask
from xshard.optim.factory import build_optimizer_with_rules

BATCH, STEPS = 16, 3
MESH = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
#: mesh=cpu2x4_slices: a periodic axis ``slice`` of 2 replicas, each over ``data``.
SLICES = Mesh(
    np.array(jax.devices()[:8]).reshape(2, 4), ("slice", "data"), axis_types=(AxisType.Auto,) * 2
)


def _train(built, task: MLPTask, seat=None, steps=STEPS, mesh=MESH, **trainer_kw) -> list:
    """The losses (and a periodic axis's sync statistics) in one array, the final params
    (and outer state), then its FLOPs per step (`run_step_flops`)."""
    trainer = Trainer(
        task,
        built.tx,
        mesh,
        data_axes=mesh.axis_names,
        global_batch_size=BATCH,
        hyperparams=built.hyperparams,
        periodic=built.periodic,
        seat=seat,
        **trainer_kw,
    )
    batches = iter(task.batches(BATCH, seed=0))
    first = next(batches)
    state = trainer.init(trainer.init_params(first))
    losses = []
    for step, batch in enumerate([first, *(next(batches) for _ in range(steps - 1))], 1):
        state, metrics = trainer.step(state, batch, with_stats=False)  # one program
        state, metrics = trainer.sync(state, step, metrics)  # a periodic axis's, if due
        values = metrics.host_values()
        losses += [v for k, v in sorted(values.items()) if k == "train/loss" or "sync/" in k]
    params = [np.asarray(x) for x in jax.tree.leaves((state.params, state.outer))]
    return [np.array(losses), *params, run_step_flops(trainer)]


def _population(builts, task, steps=(1, STEPS), **trainer_kw) -> list[list[np.ndarray]]:
    """Each trial's `_train` in a population, trial i training `steps[i]` steps (trial 0
    leaves first)."""
    population = Population(len(builts))
    results: list = [None] * len(builts)

    def trial(i: int) -> None:
        try:
            results[i] = _train(builts[i], task, population.seat(i), steps[i], **trainer_kw)
        except Exception as error:  # raised below, in the test's thread
            results[i] = error
        finally:
            population.leave(i)

    threads = [threading.Thread(target=trial, args=(i,)) for i in range(len(builts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


@pytest.mark.parametrize(
    "optimizer, trainer_kw, check_left",  # check_left: trial 0 too (the ZeRO stages: trial 1)
    [
        ("adam", {}, True),  # shard_map (trainer.grad_impl=manual) under vmap
        # ZeRO-3 covers stages 1 and 2 too: the gradients reduce-scattered and the optimizer
        # state sharded, under vmap, and the params gathered in the step.
        ("adam", {"zero_stage": 3}, False),
        ("momentum", {"grad_impl": "gspmd", "zero_stage": 3, "microbatches": 2}, False),
    ],
)
def test_trials_train_as_alone(optimizer, trainer_kw, check_left, compose_config):
    lrs = (1e-3, 3e-2)
    builts = [
        build_optimizer_with_rules(
            compose_config(f"optimizer={optimizer}", f"optimizer.learning_rate={lr}"), mesh=MESH
        )
        for lr in lrs
    ]
    task = MLPTask()
    left, stayed = _population(builts, task, **trainer_kw)
    # Trial 1 trains on as alone after trial 0 left (its slot trains on, its results dropped).
    *alone, flops = _train(builts[1], task, **trainer_kw)
    for a, b in zip(alone, stayed[:-1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    if check_left:
        *alone, _ = _train(builts[0], task, steps=1, **trainer_kw)
        for a, b in zip(alone, left[:-1], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert not np.allclose(left[1], stayed[1])  # the trials differ
    # Each trial's FLOPs a step: its share of the population's program, which computes more
    # than one trial's own (vmap makes the non-finite guard's cond a select of both branches).
    assert left[-1] == stayed[-1] and flops < stayed[-1] < 2 * flops


def test_trials_with_a_periodic_axis_train_as_alone(compose_config):
    # DiLoCo, its outer learning rate varied: every 2 steps a sync round of the stacked
    # trials (inner and outer params, the outer momentum); trial 0 leaves after the first.
    steps = (3, 6)
    builts = [
        build_optimizer_with_rules(
            compose_config(
                "optimizer=adam",
                "mesh=cpu2x4_slices",
                "reduction=diloco",
                "reduction.axes.slice.every_steps=2",
                f"reduction.axes.slice.outer_optimizer.learning_rate={lr}",
            ),
            mesh=SLICES,
        )
        for lr in (0.3, 0.9)
    ]
    task = MLPTask()
    population = _population(builts, task, steps, mesh=SLICES)
    *alone, _ = _train(builts[1], task, steps=steps[1], mesh=SLICES)  # trial 0: by ratio below
    for a, b in zip(alone, population[1][:-1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    # Step 1's loss, step 2's sync statistics (by name: compression_error_norm,
    # outer_update_norm, pseudo_grad_norm, ...) and loss, step 3's loss: the trials part at
    # their first outer update (Nesterov's first is (1 + momentum) x lr x the same one).
    (left, *_), (stayed, *_) = population
    assert left[0] == stayed[0] and left[3] == stayed[3]  # the loss, the pseudo-gradient
    np.testing.assert_allclose(stayed[2] / left[2], 0.9 / 0.3, rtol=1e-5)
    assert left[7] != stayed[7]  # step 3's: the replicas restarted from their outer params


def test_trials_agree_on_the_latest_step_every_one_saved():
    # A kill between two trials' saves of step 10: job 0 saved it, job 1 did not; job 2 failed
    # before it said what it saved (it left): the others do not wait for it.
    population = Population(3)
    population.leave(2)
    agreed: dict[int, int | None] = {}
    saved = {0: [5, 10], 1: [5]}
    threads = [
        threading.Thread(
            target=lambda i=i: agreed.update({i: population.agree_resume(i, saved[i])})
        )
        for i in saved
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert agreed == {0: 5, 1: 5}
    assert Population(1).agree_resume(0, []) is None  # nothing saved: start afresh
