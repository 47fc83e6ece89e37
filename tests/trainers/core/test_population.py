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


def _train(built, task: MLPTask, seat=None, steps=STEPS, **trainer_kw) -> list:
    """The losses and final params of a run, then its FLOPs per step (`run_step_flops`)."""
    trainer = Trainer(
        task,
        built.tx,
        MESH,
        global_batch_size=BATCH,
        hyperparams=built.hyperparams,
        seat=seat,
        **trainer_kw,
    )
    batches = iter(task.batches(BATCH, seed=0))
    first = next(batches)
    state = trainer.init(trainer.init_params(first))
    losses = []
    for batch in [first, *(next(batches) for _ in range(steps - 1))]:
        state, metrics = trainer.step(state, batch, with_stats=False)  # one program
        losses.append(metrics.host_values()["train/loss"])
    params = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    return [*losses, *params, run_step_flops(trainer)]


def _population(builts, task, **trainer_kw) -> list[list[np.ndarray]]:
    population = Population(len(builts))
    results: list = [None] * len(builts)

    def trial(i: int) -> None:
        try:
            steps = 1 if i == 0 else STEPS  # trial 0 leaves after its first step
            results[i] = _train(builts[i], task, population.seat(i), steps, **trainer_kw)
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
    "optimizer, trainer_kw",
    [
        ("adam", {}),  # shard_map (trainer.grad_impl=manual) under vmap
        ("momentum", {"grad_impl": "gspmd", "zero_stage": 1, "microbatches": 2}),
    ],
)
def test_trials_train_as_alone(optimizer, trainer_kw, compose_config):
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
    *alone, _ = _train(builts[0], task, steps=1, **trainer_kw)
    for a, b in zip(alone, left[:-1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert not np.allclose(left[1], stayed[STEPS])  # the trials differ
    # Each trial's FLOPs a step: its share of the population's program, which computes more
    # than one trial's own (vmap makes the non-finite guard's cond a select of both branches).
    assert left[-1] == stayed[-1] and flops < stayed[-1] < 2 * flops


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
