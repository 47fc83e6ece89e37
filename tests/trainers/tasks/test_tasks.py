"""Tests of the built-in tasks (mlp, tiny_gpt), the corpus and the sharding-rule helper."""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests import REPO
from trainers.tasks import corpus
from trainers.tasks.mlp import MLPTask
from trainers.tasks.sharding import param_shardings, param_specs, path_str
from trainers.tasks.tiny_gpt import TinyGPTTask

CONF = REPO / "conf" / "task"

# Small enough to compile and train in seconds; every sharded dim is divisible by 2.
SMALL_GPT = dict(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)


@pytest.fixture(scope="module")
def gpt() -> TinyGPTTask:
    return TinyGPTTask(**SMALL_GPT)


@pytest.fixture(scope="module")
def gpt_params(gpt):
    return gpt.init(jax.random.key(0), next(gpt.batches(4, seed=0)))


def _adam_losses(task, params, steps: int, batch_size: int, lr: float) -> list[float]:
    """Trains with plain adam on one device; returns the loss of every step."""
    opt = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch, None)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = opt.init(params), []
    for i, batch in zip(range(steps), task.batches(batch_size, seed=0)):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
        if i % 10 == 9:
            jax.block_until_ready(loss)
    return [float(x) for x in losses]


# --------------------------------------------------------------------------------------------
# Batches: shapes, determinism in (seed, step), process slices.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_task", [MLPTask, lambda: TinyGPTTask(**SMALL_GPT)])
def test_batches_are_a_pure_function_of_seed_and_step(make_task):
    task = make_task()
    from_zero = [b for _, b in zip(range(5), task.batches(8, seed=3))]
    resumed = next(task.batches(8, seed=3, start_step=4))
    for k in from_zero[4]:
        np.testing.assert_array_equal(resumed[k], from_zero[4][k])
    # A second task object (a new run) yields the same data; another seed does not.
    again = next(make_task().batches(8, seed=3))
    other = next(task.batches(8, seed=4))
    key = next(iter(again))
    np.testing.assert_array_equal(again[key], from_zero[0][key])
    assert not np.array_equal(other[key], from_zero[0][key])
    assert not np.array_equal(from_zero[1][key], from_zero[0][key])


@pytest.mark.parametrize("make_task", [MLPTask, lambda: TinyGPTTask(**SMALL_GPT)])
def test_process_slices_concatenate_to_the_global_batch(make_task):
    task = make_task()
    whole = next(task.batches(12, seed=0, start_step=7))
    parts = [
        next(task.batches(12, seed=0, start_step=7, process_index=p, process_count=3))
        for p in range(3)
    ]
    for k in whole:
        assert all(part[k].shape[0] == 4 for part in parts)
        np.testing.assert_array_equal(np.concatenate([part[k] for part in parts]), whole[k])
    with pytest.raises(ValueError, match="not divisible"):
        task.batches(10, seed=0, process_count=3)


def test_batch_shapes_and_dtypes(gpt):
    mlp_batch = next(MLPTask().batches(8, seed=0))
    assert mlp_batch["x"].shape == (8, 16) and mlp_batch["x"].dtype == np.float32
    assert mlp_batch["y"].shape == (8, 4) and mlp_batch["y"].dtype == np.float32
    gpt_batch = next(gpt.batches(8, seed=0))
    for k in ("inputs", "targets"):
        assert gpt_batch[k].shape == (8, 16) and gpt_batch[k].dtype == np.int32
    np.testing.assert_array_equal(gpt_batch["inputs"][:, 1:], gpt_batch["targets"][:, :-1])
    assert gpt_batch["inputs"].min() >= 0 and gpt_batch["inputs"].max() < 128


# --------------------------------------------------------------------------------------------
# task=mlp.
# --------------------------------------------------------------------------------------------


def test_mlp_loss_decreases_with_adam():
    task = MLPTask()
    params = task.init(jax.random.key(0), next(task.batches(32, seed=0)))
    losses = _adam_losses(task, params, steps=100, batch_size=32, lr=3e-3)
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), losses[::10]


def test_mlp_nan_at_step_poisons_one_row_of_that_step_only():
    task = MLPTask(nan_at_step=3)
    batches = [b for _, b in zip(range(6), task.batches(8, seed=0))]
    for step, batch in enumerate(batches):
        bad_rows = np.flatnonzero(~np.isfinite(batch["x"]).all(axis=1))
        assert list(bad_rows) == ([0] if step == 3 else []), step
        assert np.isfinite(batch["y"]).all()
    shards = [next(task.batches(8, seed=0, start_step=3, process_index=p, process_count=2))
              for p in range(2)]  # fmt: skip
    assert np.isnan(shards[0]["x"]).sum() == 1 and np.isfinite(shards[1]["x"]).all()


def test_mlp_num_examples_ends_the_iterator():
    task = MLPTask(num_examples=100)
    assert len(list(task.batches(32, seed=0))) == 3
    assert len(list(task.batches(32, seed=0, start_step=2))) == 1
    assert len(list(task.batches(16, seed=0, process_index=1, process_count=2))) == 6


def test_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match="task.activation"):
        MLPTask(activation="swish2")


# --------------------------------------------------------------------------------------------
# task=tiny_gpt.
# --------------------------------------------------------------------------------------------


def test_corpus_is_ascii_deterministic_and_capped():
    text = corpus.corpus_text()
    assert 100_000 <= len(text) <= corpus.DEFAULT_MAX_CHARS
    assert text.isascii()
    assert corpus.corpus_text(1000) == text[:1000]
    tokens = corpus.corpus_tokens()
    assert tokens.dtype == np.uint8 and not tokens.flags.writeable and tokens.max() < 128
    assert corpus.decode(corpus.encode("caf\u00e9 ok")) == "cafe ok"


def test_the_corpus_is_the_same_whatever_the_process_imported_first():
    """PyTorch (the elastic extra) patches ``inspect.getfile`` and two ``typing`` helpers; a
    process that imported it first gathered other docstrings, so an elastic group's standby
    trained and evaluated on other text than its peers. Two fresh processes, one importing
    torch first, get the same corpus."""
    pytest.importorskip("torch")

    def digest(first: str) -> str:
        probe = (
            f"import hashlib{first}; from trainers.tasks.corpus import corpus_tokens; "
            "print(hashlib.sha1(corpus_tokens().tobytes()).hexdigest())"
        )
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout.strip()

    assert digest(", torch") == digest("")


def test_tiny_gpt_init_shapes(gpt, gpt_params):
    shapes = {
        path_str(path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(gpt_params)[0]
    }
    assert shapes == {
        "embed/tokens": (128, 32),
        "embed/positions": (16, 32),
        "blocks/0/ln1/scale": (32,),
        "blocks/0/ln1/bias": (32,),
        "blocks/0/attn/wq": (32, 32),
        "blocks/0/attn/wk": (32, 32),
        "blocks/0/attn/wv": (32, 32),
        "blocks/0/attn/wo": (32, 32),
        "blocks/0/ln2/scale": (32,),
        "blocks/0/ln2/bias": (32,),
        "blocks/0/mlp/w1": (32, 64),
        "blocks/0/mlp/b1": (64,),
        "blocks/0/mlp/w2": (64, 32),
        "blocks/0/mlp/b2": (32,),
        "ln_f/scale": (32,),
        "ln_f/bias": (32,),
    }
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(gpt_params))
    untied = TinyGPTTask(**SMALL_GPT, tie_embeddings=False)
    params = untied.init(jax.random.key(0), next(untied.batches(2, seed=0)))
    assert params["head"]["w"].shape == (32, 128)


def test_tiny_gpt_initial_loss_is_log_vocab(gpt, gpt_params):
    loss, aux = gpt.loss(gpt_params, next(gpt.batches(16, seed=0)), None)
    assert abs(float(loss) - math.log(128)) < 0.1
    assert 0.0 <= float(aux["accuracy"]) <= 1.0


def test_tiny_gpt_is_causal(gpt, gpt_params):
    inputs = next(gpt.batches(2, seed=0))["inputs"]
    changed = inputs.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    before, after = gpt.apply(gpt_params, inputs), gpt.apply(gpt_params, changed)
    np.testing.assert_allclose(after[:, :10], before[:, :10], atol=1e-6)
    assert not np.allclose(after[:, 10:], before[:, 10:])


def _written_out_attention(p, x, n_heads):
    """The causal attention as tiny_gpt wrote it before `jax.nn.dot_product_attention`."""
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, n_heads, d // n_heads)
    q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k).astype(jnp.float32) / math.sqrt(d // n_heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, t, d) @ p["wo"]


@pytest.mark.parametrize("n_heads", [2, 4])  # head widths 16 and 8: scale 1/4 and 1/sqrt(8)
def test_tiny_gpt_library_attention_and_loss_match_the_written_out_formulas(
    gpt, gpt_params, n_heads
):
    from trainers.tasks.gpt_layers import causal_attention

    attn = gpt_params["blocks"][0]["attn"]
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))
    ours = jax.jit(causal_attention, static_argnums=2)
    written = jax.jit(_written_out_attention, static_argnums=2)
    np.testing.assert_array_equal(ours(attn, x, n_heads), written(attn, x, n_heads))  # bitwise
    grad = lambda f: jax.jit(jax.grad(lambda p: jnp.sum(f(p, x, n_heads) ** 2)))(attn)
    for a, b in zip(jax.tree.leaves(grad(causal_attention)), jax.tree.leaves(grad(written))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # transposes in another order

    batch = next(gpt.batches(4, seed=0))
    logits = gpt.apply(gpt_params, batch["inputs"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], axis=-1)
    np.testing.assert_allclose(gpt.loss(gpt_params, batch, None)[0], nll.mean(), rtol=1e-6)


def test_tiny_gpt_loss_decreases_with_adam(gpt, gpt_params):
    losses = _adam_losses(gpt, gpt_params, steps=50, batch_size=16, lr=1e-2)
    assert all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses[::5]


def test_tiny_gpt_sample(gpt, gpt_params):
    text = gpt.sample(gpt_params, "The ", 5)
    assert len(text) == 5 and text.isascii()
    assert gpt.sample(gpt_params, "The ", 5) == text  # greedy is deterministic
    assert len(gpt.sample(gpt_params, "", 3, rng=jax.random.key(1))) == 3


# --------------------------------------------------------------------------------------------
# Sharding rules.
# --------------------------------------------------------------------------------------------


def _flat_specs(specs) -> dict[str, P]:
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {path_str(path): spec for path, spec in leaves}


def test_param_specs_on_a_model_axis(gpt, gpt_params):
    specs = _flat_specs(
        param_specs(gpt_params, gpt.sharding_rules, ("data", "model"), {"data": 4, "model": 2})
    )
    assert specs["blocks/0/attn/wq"] == P(None, "model")
    assert specs["blocks/0/attn/wv"] == P(None, "model")
    assert specs["blocks/0/attn/wo"] == P("model", None)
    assert specs["blocks/0/mlp/w1"] == P(None, "model")
    assert specs["blocks/0/mlp/b1"] == P("model")
    assert specs["blocks/0/mlp/w2"] == P("model", None)
    assert specs["embed/tokens"] == P(None, "model")
    for path in ("blocks/0/ln1/scale", "blocks/0/mlp/b2", "ln_f/bias"):
        assert specs[path] == P(), path


def test_param_specs_without_a_model_axis_are_replicated(gpt, gpt_params):
    specs = _flat_specs(param_specs(gpt_params, gpt.sharding_rules, ("data",), {"data": 8}))
    assert all(all(e is None for e in spec) for spec in specs.values()), specs


def test_param_specs_rule_order_and_fullmatch():
    params = {"layers": [{"w": np.zeros((4, 4)), "wo": np.zeros((4, 4))}]}
    rules = [(r"layers/.*/w", P("model")), (r"layers/.*", P(None, "model"))]
    specs = _flat_specs(param_specs(params, rules, ("model",)))
    assert specs == {"layers/0/w": P("model"), "layers/0/wo": P(None, "model")}
    # Axes missing from the mesh are dropped from tuples too.
    specs = _flat_specs(param_specs(params, [(".*", P(("data", "model")))], ("model",)))
    assert specs["layers/0/w"] == P("model")


def test_param_specs_reject_indivisible_shapes(gpt_params):
    rules = [(r"blocks/\d+/attn/wq", P(None, "model"))]
    with pytest.raises(ValueError, match=r"blocks/0/attn/wq.*\(32, 32\).*model.*size 3"):
        param_specs(gpt_params, rules, ("data", "model"), {"data": 2, "model": 3})
    with pytest.raises(ValueError, match="ln_f/scale"):
        param_specs(gpt_params, [("ln_f/scale", P(None, "model"))], ("model",))


def test_mlp_specs_fit_a_model_axis():
    task = MLPTask()
    params = jax.eval_shape(task.init, jax.random.key(0), next(task.batches(4, seed=0)))
    specs = _flat_specs(param_specs(params, task.sharding_rules, ("data", "model"),
                                    {"data": 4, "model": 2}))  # fmt: skip
    assert specs["layers/0/w"] == P(None, "model") and specs["layers/1/b"] == P("model")
    assert specs["layers/2/w"] == P("model", None) and specs["layers/2/b"] == P()


@pytest.mark.parametrize("make_task", [MLPTask, lambda: TinyGPTTask(**SMALL_GPT)])
def test_sharded_loss_matches_unsharded(make_task):
    task = make_task()
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    batch = next(task.batches(8, seed=0))
    params = task.init(jax.random.key(0), batch)
    expected, _ = jax.jit(task.loss)(params, batch, None)

    shardings = param_shardings(params, task.sharding_rules, mesh)
    sharded = jax.device_put(params, shardings)
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(
        jax.tree.map(lambda x: x.sharding, sharded)))  # fmt: skip
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    loss, _ = jax.jit(task.loss)(sharded, sharded_batch, None)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Hydra configs.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cls", [("mlp", MLPTask), ("tiny_gpt", TinyGPTTask)])
def test_hydra_config_instantiates_a_working_task(name, cls, compose_config):
    from trainers.app.builders import build_task

    # Composed as a run composes it: the task's node reads e.g. ${trainer.remat}.
    task = build_task(compose_config(f"task={name}"))
    assert isinstance(task, cls) and task.name == name
    assert task.sharding_rules
    batch = next(task.batches(4, seed=0))
    params = jax.eval_shape(task.init, jax.random.key(0), batch)
    loss, aux = jax.eval_shape(task.loss, params, batch, None)
    assert loss.shape == () and all(v.shape == () for v in aux.values())
