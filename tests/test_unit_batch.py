"""xshard.unit_batch on 8 simulated CPU devices: per-shard gradients in shard_map compile to
canonical matmuls (YNNPACK fusions, no plain `dot`) with the unit batch axis, to folded,
non-canonical dots without it, and the values do not change."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.tasks.tiny_gpt import TinyGPTTask
from trainers.trainer import Trainer
from xshard import cross_shard
from xshard.unit_batch import TRANSPOSE_FOLDING_BACKENDS, unit_batch, unit_batch_by_default

PLAIN_DOT = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = \S+ dot\(", re.MULTILINE)


def plain_dots(compiled: jax.stages.Compiled) -> list[str]:
    """The dots of the entry computation that are not inside a (YNNPACK) fusion."""
    text = compiled.as_text()
    return PLAIN_DOT.findall(text[text.index("\nENTRY") :])


def loss(w, x):
    h = jnp.tanh(x @ w["a"])
    return jnp.mean(jnp.tanh(h @ w["b"]) ** 2)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def inputs():
    rng = np.random.default_rng(0)
    w = {
        "a": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32) / 4,
        "b": jnp.asarray(rng.normal(size=(32, 8)), jnp.float32) / 6,
    }
    return w, jnp.asarray(rng.normal(size=(64, 12, 16)), jnp.float32)


def per_shard_grads(mesh, enabled):
    """jit(shard_map(psum of each shard's gradient)) with `unit_batch` on or off."""

    def body(w, x):
        local = jax.lax.pcast(w, ("data",), to="varying")
        value, grads = unit_batch(jax.value_and_grad(loss), (1,), enabled=enabled)(local, x)
        return jax.lax.psum(value, "data"), jax.lax.psum(grads, "data")

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    return jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))


def test_default_rule_is_the_backend():
    assert unit_batch_by_default() == (jax.default_backend() in TRANSPOSE_FOLDING_BACKENDS)
    assert "cpu" in TRANSPOSE_FOLDING_BACKENDS


def test_disabled_returns_the_function_itself():
    fn = jax.value_and_grad(loss)
    assert unit_batch(fn, (1,), enabled=False) is fn


def test_same_values(mesh):
    w, x = inputs()
    value_on, grads_on = per_shard_grads(mesh, True)(w, x)
    value_off, grads_off = per_shard_grads(mesh, False)(w, x)
    np.testing.assert_allclose(value_on, value_off, rtol=1e-6)
    for key in w:
        assert grads_on[key].shape == w[key].shape
        np.testing.assert_allclose(grads_on[key], grads_off[key], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot emission")
def test_weight_gradients_become_canonical_matmuls(mesh):
    w, x = inputs()
    off = per_shard_grads(mesh, False).lower(w, x).compile()
    on = per_shard_grads(mesh, True).lower(w, x).compile()
    # Without it XLA folds the gradients' transposes into their dots (plain dots); with it,
    # every matmul is a YNNPACK fusion, as under GSPMD.
    assert len(plain_dots(off)) == 2
    assert plain_dots(on) == []
    assert on.as_text().count('"__ynn_fusion"') > off.as_text().count('"__ynn_fusion"')


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot emission")
def test_trainer_manual_step_has_no_plain_dots(mesh):
    """The trainer's per-shard step of the transformer: every matmul is a fusion."""
    task = TinyGPTTask(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)
    tx = cross_shard(optax.adam(1e-3), "mean", axis_name="data", skip_nonfinite=True)
    trainer = Trainer(task, tx, mesh, global_batch_size=16)
    batch = next(iter(task.batches(16, seed=0)))
    state = trainer.init(trainer.init_params(batch))
    state, _ = trainer.step(state, batch)
    assert plain_dots(trainer.compiled) == []
