"""Float hyperparameters as inputs of the compiled programs (`xshard.optim.hyperparams`): builds
of two configs that differ only in such a value lower to the same program, for every option of
conf/optimizer and for a periodic axis's outer optimizer; a float the schemas mark structural
stays a constant; docs/sweeps.md shows the table the rules give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests import REPO
from trainers.tasks.mlp import MLPTask
from xshard.config.program_inputs import hyperparameter_table
from xshard.optim.factory import build_optimizer_with_rules

OPTIMIZERS = sorted(p.stem for p in (REPO / "conf" / "optimizer").glob("*.yaml"))
#: A float of each option other than its learning rate, set to another value (sgd has none:
#: its momentum is null, which builds no momentum).
OTHER = {
    "adafactor": ["optimizer.decay_rate=0.7"],
    "adagrad": ["optimizer.eps=1e-6"],
    "adam": ["optimizer.b1=0.8"],
    "adamw": ["optimizer.weight_decay=0.05"],
    "adopt": ["optimizer.b2=0.99"],
    "lamb": ["optimizer.weight_decay=0.05"],
    "lars": ["optimizer.trust_coefficient=0.01"],
    "lion": ["optimizer.b1=0.8"],
    "momentum": ["optimizer.momentum=0.5"],
    "muon": ["optimizer.beta=0.9"],
    "rmsprop": ["optimizer.decay=0.8"],
    "schedule_free_adamw": ["optimizer.b1=0.8"],
    "sgd": [],
}


@pytest.fixture(scope="module")
def params():
    task = MLPTask()
    batch = next(iter(task.batches(16, seed=0)))
    return jax.eval_shape(task.init, jax.random.key(0), batch)


def _update_text(built, values, params) -> str:
    """The StableHLO of one update of `built`'s optimizer rebuilt on `values` as inputs."""
    tx = built.hyperparams.build(built.hyperparams.values).tx
    state = jax.eval_shape(tx.init, params)

    def update(grads, state, params, values):
        return built.hyperparams.build(values).tx.update(grads, state, params)

    inputs = {k: jnp.float32(v) for k, v in values.items()}
    return jax.jit(update).lower(params, state, params, inputs).as_text()


def _constant_text(built, params) -> str:
    """The StableHLO of one update of `built.tx`, its values constants."""
    state = jax.eval_shape(built.tx.init, params)
    return jax.jit(built.tx.update).lower(params, state, params).as_text()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_values_of_a_float_lower_to_the_same_program(name, compose_config, params):
    assert set(OTHER) == set(OPTIMIZERS)
    schedule = ["schedule=constant"] if name == "schedule_free_adamw" else []
    first = compose_config(f"optimizer={name}", *schedule, "clip=0.5")
    second = compose_config(
        f"optimizer={name}",
        *schedule,
        "clip=2.0",
        "optimizer.learning_rate=0.25",
        *OTHER[name],
    )
    a, b = build_optimizer_with_rules(first), build_optimizer_with_rules(second)
    assert a.hyperparams.values != b.hyperparams.values
    assert set(a.hyperparams.values) == set(b.hyperparams.values)
    assert "optimizer.learning_rate" in a.hyperparams.values and "clip" in a.hyperparams.values
    assert _update_text(a, a.hyperparams.values, params) == _update_text(
        b, b.hyperparams.values, params
    )
    # As constants, the two differ: the test above can fail.
    assert _constant_text(a, params) != _constant_text(b, params)


def test_an_outer_optimizer_lowers_to_the_same_program(compose_config, params):
    first = compose_config("reduction=diloco", "mesh=cpu2x4_slices")
    second = compose_config(
        "reduction=diloco",
        "mesh=cpu2x4_slices",
        "reduction.axes.slice.outer_optimizer.learning_rate=0.3",
        "reduction.axes.slice.outer_optimizer.momentum=0.5",
    )
    a, b = build_optimizer_with_rules(first), build_optimizer_with_rules(second)
    key = "reduction.axes.slice.outer_optimizer"
    assert (
        a.hyperparams.values[f"{key}.learning_rate"],
        a.hyperparams.values[f"{key}.momentum"],
    ) == (0.3, 0.9)  # the preset's, from the sweep in docs/reductions.md

    def text(built, constants: bool) -> str:
        values = {k: jnp.float32(v) for k, v in built.hyperparams.values.items()}
        outer = lambda v: built.hyperparams.build(v).axis_rules["slice"].outer_optimizer
        state = jax.eval_shape(outer({}).init, params)
        if constants:
            return jax.jit(outer({}).update).lower(params, state, params).as_text()
        fn = lambda g, s, p, v: outer(v).update(g, s, p)
        return jax.jit(fn).lower(params, state, params, values).as_text()

    assert text(a, constants=False) == text(b, constants=False)
    assert text(a, constants=True) != text(b, constants=True)


def test_a_float_the_schema_marks_structural_is_not_an_input(compose_config):
    cfg = compose_config("optimizer=adafactor", "schedule=exponential", "schedule.end_factor=0.1")
    values = build_optimizer_with_rules(cfg).hyperparams.values
    assert "schedule.end_factor" in values and "optimizer.decay_rate" in values
    assert "schedule.decay_rate" not in values  # structural: optax branches on it
    assert "optimizer.min_dim_size_to_factor" not in values  # an integer
    assert "schedule.transition_steps" not in values
    # null chooses the structure: no momentum, no input
    assert "optimizer.momentum" not in values and "optimizer.weight_decay_rate" in values


def test_docs_show_the_table_the_rules_give():
    table = hyperparameter_table()
    assert "| `schedule` | `decay_rate` | constant: optax.exponential_decay branches" in table
    assert "outer_optimizer` | `learning_rate` | input |" in table
    assert table in (REPO / "docs" / "sweeps.md").read_text()
