"""Mixed precision and rematerialisation in-process, on 8 simulated CPU devices.

XLA:CPU computes bfloat16 dots in float32 after its own rewrites, so the dtypes are read from
the lowered program (StableHLO, what the trainer asks the compiler for); on an accelerator
(`benchmarks/device_check.sh`) the compiled program's dots are checked too.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import xshard
from tests.hlo_helpers import dot_dtypes
from trainers.config.precision import NO_REMAT, REMAT_POLICIES, PrecisionOptions
from trainers.core.precision import Precision
from trainers.core.trainer import Hook, Trainer
from trainers.tasks.remat import XLA_CPU_KEEP_REMAT
from trainers.tasks.synthetic import TeacherRegression
from trainers.tasks.tiny_gpt import TinyGPTTask
from xshard.errors import ConfigError

pytestmark = pytest.mark.slow  # ~100 s of in-process compiles (make test runs them)

BATCH = 16
SMALL_GPT = dict(d_model=32, n_heads=2, n_layers=2, d_ff=64, seq_len=16, corpus_max_chars=20000)
BF16 = Precision.of("float32", "bfloat16")
RULES = {"embed": None, "mlp": None}


def mesh8():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


class Losses(Hook):
    def __init__(self):
        self.losses = []

    def on_step(self, step, metrics):
        self.losses.append(metrics["train/loss"])


def trainer_and_state(task, precision=None, lr=3e-3):
    tx = xshard.cross_shard(optax.adam(lr), "mean")
    trainer = Trainer(task, tx, mesh8(), global_batch_size=BATCH, precision=precision)
    first = next(iter(task.batches(BATCH, seed=0)))
    return trainer, trainer.init(*trainer.init_variables(first)), first


def train(task, steps, precision=None):
    trainer, state, _ = trainer_and_state(task, precision)
    rec = Losses()
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=steps, hooks=[rec])
    state = result.state
    return np.array(rec.losses), jax.device_get(state)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def test_remat_names_are_jax_checkpoint_policies():
    for name in REMAT_POLICIES:
        if name in (NO_REMAT, "full"):
            continue
        policy = getattr(jax.checkpoint_policies, name)  # AttributeError: gone from JAX
        params = inspect.signature(policy).parameters
        assert all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()) or (
            "prim" in params
        ), f"{name} is a policy factory, not a policy"


@pytest.mark.parametrize(
    "node, message",
    [
        ({"compute_dtype": "float16"}, "precision.compute_dtype='float16' is not allowed"),
        ({"param_dtype": "fp32"}, "precision.param_dtype='fp32' is not allowed; choose one"),
        ({"dtype": "bfloat16"}, "precision.dtype: unknown key"),
    ],
)
def test_bad_precision_is_one_line_naming_the_key(node, message):
    with pytest.raises(ConfigError) as err:
        PrecisionOptions.from_config(node)
    assert message in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision, dtype", [(None, "f32"), (BF16, "bf16")])
def test_the_step_program_dots_compute_in_the_compute_dtype(precision, dtype):
    task = TinyGPTTask(**SMALL_GPT)
    trainer, state, first = trainer_and_state(task, precision)
    lowered = trainer.lower(0, state, trainer.global_batch(first))
    assert dot_dtypes(lowered.as_text()) == {dtype}
    if jax.default_backend() != "cpu":  # an accelerator keeps bfloat16 dots after compiling
        assert dot_dtypes(lowered.compile().as_text()) == {dtype}
    # The master params and the optimizer state stay float32.
    floats = {str(x.dtype) for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {"float32"}


def test_bf16_trains_tiny_gpt_within_tolerance_of_fp32_and_keeps_float32_state():
    task = TinyGPTTask(**SMALL_GPT)
    fp32, state32 = train(task, 30)
    bf16, state16 = train(task, 30, BF16)
    # bfloat16 has 8 mantissa bits: per-step losses within 2% of float32's over 30 steps of
    # adam at 3e-3, and the same progress (the loss falls by more than 25% in both).
    np.testing.assert_allclose(bf16, fp32, rtol=0.02)
    assert bf16[-1] < 0.75 * bf16[0] and fp32[-1] < 0.75 * fp32[0]
    assert not np.array_equal(bf16, fp32)  # it did compute in another dtype
    for tree in (state16.params, state16.opt_state):
        for x in jax.tree.leaves(tree):
            assert x.dtype != np.dtype("bfloat16")


def test_bf16_params_cast_the_loss_back_to_float32():
    task = TinyGPTTask(**SMALL_GPT)
    pure = Precision.of("bfloat16", "bfloat16")
    trainer, state, first = trainer_and_state(task, pure)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("bfloat16")}
    state, metrics = trainer.step(state, first)
    assert np.isfinite(metrics["train/loss"]) and np.isfinite(metrics["grad/global_norm"])


# --------------------------------------------------------------------------------------------
# Rematerialisation
# --------------------------------------------------------------------------------------------


def test_remat_gives_the_same_numbers_and_recomputes_each_block():
    plain, state = train(TinyGPTTask(**SMALL_GPT), 3)
    remat, remat_state = train(TinyGPTTask(**SMALL_GPT, remat="full"), 3)
    # The same losses, and params within 1e-6 (XLA may reassociate a sum in the recomputed
    # backward pass; adam's normalised update then moves a near-zero gradient's weight by ~1e-7).
    np.testing.assert_allclose(remat, plain, rtol=1e-6)
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=0, atol=1e-6),
        remat_state.params,
        state.params,
    )


def test_remat_puts_each_block_behind_an_optimization_barrier():
    """The recomputed forward pass of each block starts at an optimization barrier (what
    ``jax.checkpoint`` lowers to, so that XLA does not merge it back into the forward)."""
    trainer, state, first = trainer_and_state(TinyGPTTask(**SMALL_GPT))
    barriers = "stablehlo.optimization_barrier"
    assert barriers not in trainer.lower(0, state, trainer.global_batch(first)).as_text()
    trainer, state, first = trainer_and_state(TinyGPTTask(**SMALL_GPT, remat="dots_saveable"))
    text = trainer.lower(0, state, trainer.global_batch(first)).as_text()
    assert text.count(barriers) >= SMALL_GPT["n_layers"]


def test_full_remat_lowers_the_compiled_steps_temporaries():
    """On a GPT whose activations outweigh its state (128 tokens, 4 blocks: the attention
    scores dominate), the compiled step of remat=full needs under 60% of the temporaries of
    none. Compiled with `XLA_CPU_KEEP_REMAT`, as a GPU or TPU compiles: XLA:CPU's default
    pipeline drops the barriers and merges the recomputation back (`trainers.tasks.remat`)."""
    gpt = dict(SMALL_GPT, seq_len=128, n_layers=4)
    temps = {}
    for remat in ("none", "full"):
        trainer, state, first = trainer_and_state(TinyGPTTask(**gpt, remat=remat))
        lowered = trainer.lower(0, state, trainer.global_batch(first))
        compiled = lowered.compile(compiler_options=XLA_CPU_KEEP_REMAT)
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["full"] < 0.6 * temps["none"], temps


# --------------------------------------------------------------------------------------------
# Flax adapters
# --------------------------------------------------------------------------------------------


def flax_task(kind, **options):
    """A Flax task; the test skips where flax (an optional extra) is not installed."""
    pytest.importorskip("flax")
    from trainers.tasks import linen_models, nnx_models
    from trainers.tasks.flax_linen import LinenTask
    from trainers.tasks.flax_nnx import NNXTask

    data = TeacherRegression()
    if kind == "nnx":
        return NNXTask(functools.partial(nnx_models.MLP), data, logical_axis_rules=RULES, **options)
    return LinenTask(linen_models.MLP(), data, logical_axis_rules=RULES, **options)


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_flax_models_get_dtype_param_dtype_and_compute_in_bf16(kind):
    task = flax_task(kind, dtype="bfloat16", param_dtype="float32")
    trainer, state, first = trainer_and_state(task, BF16)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert dot_dtypes(trainer.lower(0, state, trainer.global_batch(first)).as_text()) == {"bf16"}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_flax_remat_gives_the_same_numbers(kind):
    plain, _ = train(flax_task(kind), 3)
    remat, _ = train(flax_task(kind, remat="dots_saveable"), 3)
    np.testing.assert_allclose(remat, plain, rtol=1e-6)


def test_a_flax_model_without_remat_argument_refuses_a_policy():
    pytest.importorskip("flax")
    from trainers.tasks import nnx_models
    from trainers.tasks.flax_nnx import NNXTask

    def model(*, rngs):
        return nnx_models.MLP(rngs=rngs)

    task = NNXTask(model, TeacherRegression(), logical_axis_rules=RULES, remat="full")
    with pytest.raises(ValueError, match="task.model takes no `remat` argument"):
        trainer_and_state(task)
