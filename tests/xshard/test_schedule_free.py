"""optimizer=schedule_free_adamw's rules (xshard/optim/schedule_free.py): a decaying schedule and
b1=0 refused, a constant or warmup-only one accepted; `eval_params` finds the schedule-free state
inside the built `cross_shard` optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_module

import xshard
from xshard import ConfigError
from xshard.optim.schedule_free import eval_params

PARAMS = {"w": jnp.ones((4, 4)), "b": jnp.zeros((4,))}


def build(*overrides: str):
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train", overrides=["optimizer=schedule_free_adamw", "task=mlp", *overrides]
        )
    return xshard.build_optimizer(cfg)


@pytest.mark.parametrize(
    "schedule, where",
    [
        (("schedule=cosine",), "at step 1,"),
        (("schedule=warmup_cosine", "trainer.steps=1000"), "at step 64,"),  # after its warmup
        (("schedule=exponential",), "at step 1,"),
    ],
)
def test_a_decaying_schedule_is_refused(schedule, where):
    with pytest.raises(ConfigError) as e:
        build(*schedule)
    message = str(e.value)
    assert message.startswith("schedule._target_='xshard.schedules."), message
    assert "decays the learning rate" in message and where in message, message
    assert "optax.contrib.schedule_free_adamw is schedule-free" in message
    assert message.endswith("Use schedule=constant (warm up with optimizer.warmup_steps).")


@pytest.mark.parametrize(
    "schedule",
    [
        ("schedule=constant",),
        ("schedule=constant", "optimizer.warmup_steps=10"),
        # Warmup only: the run ends before the decay starts.
        ("schedule=warmup_cosine", "trainer.steps=20", "schedule.warmup_steps=20"),
    ],
)
def test_a_constant_or_warmup_only_schedule_is_accepted(schedule):
    tx = build(*schedule)
    state = tx.init(PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = tx.update(grads, state, PARAMS)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_b1_zero_is_refused():
    with pytest.raises(ConfigError, match=r"^optimizer\.b1=0: .* expected 0 < b1 < 1\.$"):
        build("schedule=constant", "optimizer.b1=0")


def test_eval_params_of_the_built_optimizer_are_schedule_free_eval_params():
    tx = build("schedule=constant", "optimizer.learning_rate=0.1")
    state, params = tx.init(PARAMS), PARAMS
    for i in range(3):
        grads = jax.tree.map(lambda x, i=i: jnp.full_like(x, 1.0 + i), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    (sf,) = xshard.optim.slots.find_states(state, optax.contrib.ScheduleFreeState)
    want = optax.contrib.schedule_free_eval_params(sf, params)
    got = eval_params(state, params)
    for a, b, raw in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
        assert not np.allclose(a, raw)  # the average x, not the raw y


def test_eval_params_of_another_optimizer_are_its_params():
    tx = xshard.cross_shard(optax.adamw(1e-3), "mean")
    assert eval_params(tx.init(PARAMS), PARAMS) is PARAMS
