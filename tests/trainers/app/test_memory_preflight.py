"""The memory preflight's estimate (trainers.app.memory_preflight) against real state: the
params and optimizer state it predicts from shapes are, byte for byte per device, what
`Trainer.init` allocates, on meshes with data and model axes and every ZeRO stage; and it
allocates nothing itself, even for a model of terabytes."""

from __future__ import annotations

import functools
import resource
import subprocess
import sys

import jax
import numpy as np
import pytest
from hydra import compose, initialize_config_module
from jax.sharding import AxisType, Mesh

from trainers.app.memory_preflight import estimate_memory, example_shapes, size_key
from trainers.core.trainer import Trainer
from trainers.core.zero import bytes_per_device
from trainers.tasks.mlp import MLPTask
from trainers.tasks.tiny_gpt import TinyGPTTask
from xshard.mesh.simulated import MAX_SIMULATED_CPU_DEVICES
from xshard.optim.factory import build_optimizer

BATCH = 16


def mesh_of(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


@functools.cache
def optimizer_config(name: str):
    with initialize_config_module("xshard.conf", version_base="1.3"):
        return compose("xshard_train", overrides=["task=mlp", f"optimizer={name}"])


def trainer_for(task, optimizer, stage, mesh):
    tx = build_optimizer(optimizer_config(optimizer), mesh=mesh)
    return Trainer(task, tx, mesh, global_batch_size=BATCH, zero_stage=stage)


def state_bytes(tree) -> int:
    return sum(bytes_per_device(x, x.sharding) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "task, optimizer, stage, shape",
    [
        (MLPTask(hidden=(64, 64)), "adamw", 0, (8,)),
        (MLPTask(hidden=(128, 128)), "adafactor", 1, (8,)),  # factored moments
        (MLPTask(hidden=(64, 64)), "lion", 2, (4, 2)),  # data and model axes
        (MLPTask(hidden=(64, 64)), "adamw", 3, (4, 2)),  # params sharded at rest too
        (TinyGPTTask(d_model=32, n_layers=1, d_ff=64, seq_len=16), "adamw", 3, (8,)),
    ],
    ids=["mlp-adamw-0", "mlp-adafactor-1", "mlp-lion-2-model", "mlp-adamw-3-model", "gpt-3"],
)
def test_estimate_equals_the_initialised_state(task, optimizer, stage, shape):
    mesh = mesh_of(shape, ("data", "model")[: len(shape)])
    trainer = trainer_for(task, optimizer, stage, mesh)
    batch = next(iter(task.batches(BATCH, seed=0)))
    estimate = estimate_memory(trainer, batch, rows=BATCH // shape[0])
    state = trainer.init(*trainer.init_variables(batch))
    assert estimate.params == state_bytes(state.params) > 0
    assert estimate.opt_state == state_bytes(state.opt_state) > 0
    per_example = sum(x[0].nbytes for x in batch.values())
    assert estimate.batch == per_example * BATCH // shape[0]
    # The step's gradients are laid out as the params, but whole over the data axes with stage 3.
    assert estimate.grads == estimate.params if stage < 3 else estimate.grads > estimate.params


def test_declared_example_shapes_give_the_same_estimate_as_data():
    task = MLPTask(hidden=(64, 64))
    trainer = trainer_for(task, "adamw", 0, mesh_of((8,), ("data",)))
    declared = {
        k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in example_shapes(task).items()
    }
    batch = next(iter(task.batches(BATCH, seed=0)))
    assert estimate_memory(trainer, declared, 2) == estimate_memory(trainer, batch, 2)
    assert {k: (v.shape, v.dtype) for k, v in example_shapes(task).items()} == {
        k: (v.shape[1:], v.dtype) for k, v in batch.items()
    }


def test_a_terabyte_model_is_estimated_without_allocating():
    # The audit's task.out_dim=1000000000: the teacher alone was 238 GiB of NumPy.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    task = MLPTask(out_dim=1_000_000_000)
    trainer = trainer_for(task, "adamw", 0, mesh_of((8,), ("data",)))
    shapes = {
        k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in example_shapes(task).items()
    }
    estimate = estimate_memory(trainer, shapes, rows=2)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert estimate.params > 64 * 10**9 * 4 and estimate.opt_state >= 2 * estimate.params
    assert estimate.largest[:2] == ("layers/2/w", (64, 1_000_000_000))
    assert grown < 200 * 2**20  # nothing of the model's size was allocated


@pytest.mark.parametrize(
    "node, shape, named",
    [
        (
            {"name": "mlp", "in_dim": 16, "hidden": [100000000], "out_dim": 4},
            (16, 100000000),
            "task.hidden=[100000000]",
        ),
        (
            {"name": "mlp", "in_dim": 16, "hidden": [64], "out_dim": 10**9},
            (64, 10**9),
            "task.out_dim=1000000000",
        ),
        (
            {"name": "f", "model": {"features": [8, 2**20]}},
            (2**20, 8),
            "task.model.features=[8, 1048576]",
        ),
        ({"name": "gpt", "seq_len": 64}, (3, 5), "task=gpt"),
    ],
)
def test_the_size_is_named_by_its_config_key(node, shape, named):
    assert size_key(node, shape) == named


def _bound_in_child(limit: int | None) -> str:
    """`simulated_device_bound()` in a fresh process, under an address-space limit."""
    cap = f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))" if limit else ""
    code = (
        f"import resource; {cap}\n"
        "from xshard.mesh.simulated import simulated_device_bound as b; print(b().limit)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout


def test_simulated_devices_are_bounded_by_the_address_space_limit():
    assert int(_bound_in_child(None)) == MAX_SIMULATED_CPU_DEVICES
    under_8g = int(_bound_in_child(8 << 30))
    assert 100 < under_8g < 550  # measured: XLA aborts at about 550 devices under 8 GiB


# ------------------------------------------------------------------ a step's compiled program


@pytest.mark.slow  # two tiny_gpt steps compiled on 8 devices
def test_the_compiled_step_measures_its_activations_and_refuses_what_cannot_fit():
    """`check_step_memory` reads XLA's memory analysis of the real compiled step: a step with
    longer sequences needs more temporaries (attention scores grow as seq_len squared), and a
    budget below the step's bytes is refused in one line naming trainer.batch_size."""
    from trainers.app.memory_preflight import MemoryAvailable, check_step_memory, step_memory

    mesh = mesh_of((8,), ("data",))
    measured = []
    for seq_len in (16, 64):
        task = TinyGPTTask(d_model=32, n_layers=1, d_ff=64, seq_len=seq_len)
        trainer = trainer_for(task, "adamw", 0, mesh)
        batch = next(iter(task.batches(BATCH, seed=0)))
        state = trainer.init(*trainer.init_variables(batch))
        periods = {"stats_every": 1, "layer_stats_every": 0, "histogram_every": 0}
        trainer.compile_run(state, batch, 1, 2, periods)
        measured.append(step_memory(trainer.executables()))
    short, long = measured
    assert short is not None and long is not None
    # seq_len 4x: activations 4x (the attention scores 16x), over buffers that do not grow
    # with it (the gradient's, the optimizer update's): 3.8x with jax.nn.dot_product_attention
    assert long.temporaries > 3 * short.temporaries
    assert long.arguments < 2 * short.arguments  # the state barely changes (positions)

    roomy = MemoryAvailable(long.total * 8 * 2, 8, "plenty")
    assert check_step_memory(trainer.executables(), roomy, BATCH) == long
    tight = MemoryAvailable(long.total * 8 - 1, 8, "this host has 1 byte too few")
    with pytest.raises(Exception, match=rf"^trainer\.batch_size={BATCH}: a compiled step needs"):
        check_step_memory(trainer.executables(), tight, BATCH)
    assert check_step_memory(trainer.executables(), None, BATCH) == long  # unknown: not refused


def test_a_population_whose_trials_cannot_fit_together_is_refused_with_how_many_fit():
    """`hydra/launcher=population` holds each trial's state twice (stacked, and the trial's
    own copy): a budget for 2 trials takes 2 and refuses 3 in one line, before compiling."""
    from trainers.app.memory_preflight import MemoryAvailable, check_population_memory

    task = MLPTask(hidden=(64, 64))
    trainer = trainer_for(task, "adamw", 0, mesh_of((8,), ("data",)))
    shapes = {
        k: jax.ShapeDtypeStruct((1, *v.shape), v.dtype) for k, v in example_shapes(task).items()
    }
    estimate = estimate_memory(trainer, shapes, rows=2)
    assert estimate.population(1) == estimate.total
    state = estimate.params + estimate.opt_state
    assert estimate.population(3) == 3 * (2 * state + estimate.grads) + estimate.batch
    budget = MemoryAvailable(estimate.population(2) * 8, 8, "this host has just enough")
    check_population_memory(estimate, budget, 2)
    check_population_memory(estimate, None, 1000)  # unknown memory: not refused
    with pytest.raises(Exception, match=r"^hydra/launcher=population: 3 trials need") as e:
        check_population_memory(estimate, budget, 3)
    assert "At most 2 trials fit" in str(e.value) and "\n" not in str(e.value)
