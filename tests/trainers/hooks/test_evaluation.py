"""Evaluation in-process on 8 simulated CPU devices: the eval step is right, compiled once,
and never changes training (trainers/hooks/evaluation.py)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import xshard
from tests.hlo_helpers import dot_dtypes
from trainers.config import TrainerOptions
from trainers.core.trainer import Trainer
from trainers.hooks.evaluation import EvalHook, Evaluator, build_evaluator, has_eval_split
from trainers.hooks.summary import RunSummary
from trainers.tasks.mlp import MLPTask
from trainers.tasks.tiny_gpt import TinyGPTTask
from xshard.config import read_node
from xshard.errors import ConfigError

BATCH = 32


def mesh_of(shape, names):
    n = int(np.prod(shape))
    devices = np.array(jax.devices()[:n]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def options(**kw) -> TrainerOptions:
    return TrainerOptions(batch_size=BATCH, **kw)


def make_trainer(task, mesh):
    tx = xshard.cross_shard(optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), "mean")
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    first = next(iter(task.batches(BATCH, seed=0)))
    return trainer, trainer.init(trainer.init_params(first))


class MAETask(MLPTask):
    """mlp with its own eval metrics (`eval_metrics`)."""

    def eval_metrics(self, params, batch):
        error = self.apply(params, batch["x"]) - batch["y"]
        return {"loss": jnp.mean(jnp.square(error)), "mae": jnp.mean(jnp.abs(error))}


def reference_metrics(task, params, batch_size, num_batches):
    """The eval metrics computed unsharded, batch by batch, on one device."""
    params = jax.device_get(params)
    sums: dict[str, float] = {}
    for i in range(num_batches):
        batch = task.global_eval_batch(batch_size, seed=0, index=i)
        if hasattr(task, "eval_metrics"):
            metrics = task.eval_metrics(params, batch)
        else:
            loss, aux = task.loss(params, batch, None)
            metrics = {**aux, "loss": loss}
        for k, v in metrics.items():
            sums[f"eval/{k}"] = sums.get(f"eval/{k}", 0.0) + float(v)
    return {k: v / num_batches for k, v in sums.items()}


@pytest.mark.parametrize("task_cls", [MLPTask, MAETask])
def test_sharded_eval_matches_unsharded_reference(task_cls):
    task = task_cls()
    mesh = mesh_of((4, 2), ("data", "model"))  # params sharded over `model` too
    _, state = make_trainer(task, mesh)
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=3), seed=0
    )
    got = evaluator.evaluate(state)
    want = reference_metrics(task, state.params, BATCH, 3)
    assert set(got) == set(want) == set(evaluator.metric_names)
    assert "eval/loss" in got and (task_cls is MLPTask or "eval/mae" in got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


def fit(task, mesh, *, steps, eval_every=None, record=None):
    trainer, state = make_trainer(task, mesh)
    hooks = []
    evaluator = None
    if eval_every is not None:
        evaluator = build_evaluator(
            task, mesh, state, data_axes=("data",), opts=options(eval_batches=2), seed=0
        )
        sinks = [record.on_eval] if record is not None else []
        hooks.append(EvalHook(evaluator, every=eval_every, num_steps=steps, sinks=sinks))
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=steps, hooks=hooks)
    state, reason = result.state, result.reason
    assert reason == "done"
    return jax.device_get(state), evaluator


def test_eval_never_changes_training_and_compiles_once(caplog):
    """Params and optimizer state are bitwise equal with evaluation after every step and
    without; the eval step is compiled once for all evaluations."""
    task = MLPTask()
    mesh = mesh_of((8,), ("data",))
    steps = 6
    plain, _ = fit(task, mesh, steps=steps)
    summary = RunSummary()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        evaluated, evaluator = fit(task, mesh, steps=steps, eval_every=1, record=summary)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(evaluated), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert summary.final_eval_step == steps  # every step evaluated, the last one too
    assert evaluator.compiles == 1
    compiled = [r.getMessage() for r in caplog.records if "eval_step" in r.getMessage()]
    assert len([m for m in compiled if "Finished XLA compilation" in m]) == 1, compiled


def test_eval_every_and_end_and_best():
    task = MLPTask()
    mesh = mesh_of((8,), ("data",))
    summary = RunSummary()
    seen = []
    trainer, state = make_trainer(task, mesh)
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=1), seed=0
    )
    hook = EvalHook(
        evaluator, every=3, num_steps=7, sinks=[summary.on_eval, lambda s, m: seen.append(s)]
    )
    trainer.fit(state, task.batches(BATCH, seed=0), num_steps=7, hooks=[hook])
    assert seen == [3, 6, 7]  # every 3 steps and the last one, each once
    assert summary.final_eval_step == 7
    assert summary.best_eval["eval/loss"] <= summary.final_eval["eval/loss"]
    lines = "\n".join(summary.eval_lines())
    assert "eval: final eval/loss" in lines


def test_eval_at_the_end_when_the_data_runs_out():
    task = MLPTask(num_examples=BATCH * 3)  # 3 steps of data
    mesh = mesh_of((8,), ("data",))
    seen = []
    trainer, state = make_trainer(task, mesh)
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=1), seed=0
    )
    hook = EvalHook(evaluator, every=0, num_steps=10, sinks=[lambda s, m: seen.append(s)])
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=10, hooks=[hook])
    reason = result.reason
    assert reason == "data_exhausted" and seen == [3]


def test_tiny_gpt_eval_split_is_held_out():
    task = TinyGPTTask(seq_len=16, corpus_max_chars=20_000, eval_fraction=0.25)
    tokens = task.tokens
    train_text = tokens[: task.eval_start].tobytes()
    assert 0 < task.eval_start < len(tokens)
    for step in range(5):  # every training window lies in the training part
        batch = task.global_batch(64, seed=0, step=step)
        rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
        assert all(train_text.find(r.astype(np.uint8).tobytes()) >= 0 for r in rows)
    windows = (len(tokens) - task.eval_start - 1) // 16
    n = task.num_eval_batches(8)
    assert n == -(-windows // 8) > 0  # the last batch holds the remainder
    first = task.global_eval_batch(8, seed=0, index=0)
    np.testing.assert_array_equal(first["inputs"][0], tokens[task.eval_start :][:16])
    np.testing.assert_array_equal(first["targets"][0], tokens[task.eval_start :][1:17])
    batches = list(task.eval_batches(8, seed=0))
    assert len(batches) == n and sum(len(b["inputs"]) for b in batches) == windows
    assert not has_eval_split(TinyGPTTask(seq_len=16, corpus_max_chars=20_000, eval_fraction=0))
    with pytest.raises(ValueError, match="task.eval_fraction=0.7"):
        TinyGPTTask(seq_len=16, corpus_max_chars=20_000, eval_fraction=0.7)


def test_tiny_gpt_evaluates_with_accuracy():
    task = TinyGPTTask(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)
    mesh = mesh_of((4, 2), ("data", "model"))
    _, state = make_trainer(task, mesh)
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=2), seed=0
    )
    metrics = evaluator.evaluate(state)
    assert set(metrics) == {"eval/loss", "eval/accuracy"}
    assert abs(metrics["eval/loss"] - np.log(128)) < 0.5  # about uniform at init


def test_the_eval_step_computes_in_the_compute_dtype():
    """precision=bf16 (float32 master params): the lowered eval program's dots are bfloat16,
    its metrics float32 and within 2% of the float32 evaluation's; without a compute dtype
    every dot is float32."""
    task = TinyGPTTask(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)
    mesh = mesh_of((8,), ("data",))
    _, state = make_trainer(task, mesh)
    metrics = {}
    for compute_dtype, dots in ((None, {"f32"}), ("bfloat16", {"bf16"})):
        evaluator = Evaluator(
            task,
            mesh,
            data_axes=("data",),
            global_batch_size=BATCH,
            num_batches=2,
            seed=0,
            compute_dtype=compute_dtype,
        )
        lowered = evaluator.lower(state)
        assert dot_dtypes(lowered.as_text()) == dots
        assert lowered.out_info.dtype == jnp.float32
        evaluator.prepare(state)
        metrics[compute_dtype] = evaluator.evaluate(state)
    assert metrics[None] != metrics["bfloat16"]  # it did compute in bfloat16
    for name, value in metrics[None].items():
        assert metrics["bfloat16"][name] == pytest.approx(value, rel=0.02), name


def tiny_gpt_reference(task: TinyGPTTask, params) -> dict[str, float]:
    """Mean next-token cross-entropy and accuracy over every whole window of the held-out
    tail, the windows cut here and the logits of one plain `task.apply` call (float64)."""
    tail = task.tokens[task.eval_start :].astype(np.int32)
    starts = np.arange((len(tail) - 1) // task.seq_len) * task.seq_len
    windows = tail[starts[:, None] + np.arange(task.seq_len + 1)]
    logits = np.asarray(task.apply(jax.device_get(params), windows[:, :-1]), np.float64)
    targets = windows[:, 1:]
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    accuracy = (logits.argmax(axis=-1) == targets).mean()
    return {"eval/loss": float(nll.mean()), "eval/accuracy": float(accuracy)}


@pytest.mark.parametrize("batch_size", [32, 40])
def test_tiny_gpt_scores_every_eval_window_once(batch_size):
    """124 windows: not a multiple of either batch size; the last batch is padded and masked."""
    task = TinyGPTTask(
        d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16, corpus_max_chars=20_000
    )
    windows = (len(task.tokens) - task.eval_start - 1) // task.seq_len
    assert windows % batch_size
    mesh = mesh_of((4, 2), ("data", "model"))
    _, state = make_trainer(task, mesh)
    opts = TrainerOptions(batch_size=BATCH, eval_batch_size=batch_size, eval_batches=100)
    evaluator = build_evaluator(task, mesh, state, data_axes=("data",), opts=opts, seed=0)
    got = evaluator.evaluate(state)
    assert (evaluator.count, evaluator.examples) == (-(-windows // batch_size), windows)
    want = tiny_gpt_reference(task, state.params)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, abs=1e-6), name
    whole = [b["inputs"] for b in task.eval_batches(batch_size, seed=0)]
    for processes in (2, 4):  # the processes' rows of each batch, together, are that batch
        shares = [
            [b["inputs"] for b in task.eval_batches(batch_size, seed=0, **split)]
            for split in (dict(process_index=p, process_count=processes) for p in range(processes))
        ]
        assert {len(batches) for batches in shares} == {len(whole)}
        for j, batch in enumerate(whole):
            np.testing.assert_array_equal(np.concatenate([s[j] for s in shares]), batch)


def test_mlp_eval_split_is_not_the_training_data():
    task = MLPTask()
    train = task.global_batch(8, seed=0, step=0)["x"]
    held_out = task.global_eval_batch(8, seed=0, index=0)["x"]
    assert not np.array_equal(train, held_out)
    # The same eval set for every run seed: a seed sweep is compared on the same data.
    np.testing.assert_array_equal(held_out, task.global_eval_batch(8, seed=5, index=0)["x"])


# ------------------------------------------------------------------ config and objective


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("eval_every", -1, "trainer.eval_every=-1: expected an integer"),
        ("eval_batches", "x", "trainer.eval_batches='x': expected an integer"),
        ("eval_batch_size", 0, "trainer.eval_batch_size=0: expected an integer, >= 1"),
        ("objective", "loss", "trainer.objective='loss': expected 'train/loss'"),
        ("objective", "eval/", "trainer.objective='eval/': expected 'train/loss'"),
    ],
)
def test_bad_eval_options_are_config_errors(key, value, message):
    node = {k: getattr(TrainerOptions(), k) for k in TrainerOptions.__dataclass_fields__}
    with pytest.raises(ConfigError) as err:
        read_node(TrainerOptions, {**node, key: value}, "trainer")
    assert message in str(err.value)


def test_objective_must_be_a_metric_of_the_evaluation():
    task = MLPTask()
    mesh = mesh_of((8,), ("data",))
    _, state = make_trainer(task, mesh)

    def build(**kw):
        return build_evaluator(task, mesh, state, data_axes=("data",), opts=options(**kw), seed=0)

    with pytest.raises(ConfigError, match=r"trainer.objective='eval/accuracy': the evaluation has"):
        build(objective="eval/accuracy")
    with pytest.raises(ConfigError, match="trainer.eval_batches=0 turns evaluation off"):
        build(objective="eval/loss", eval_batches=0)
    with pytest.raises(ConfigError, match="trainer.eval_batch_size=12 is not divisible"):
        build(eval_batch_size=12)
    assert build(eval_batches=0) is None
    small = MLPTask()
    small.num_eval_batches = lambda size: 0  # an eval split too small for the batch
    with pytest.raises(ConfigError, match="the task's eval split yields no batch"):
        build_evaluator(small, mesh, state, data_axes=("data",), opts=options(), seed=0)


def test_evaluator_needs_prepare():
    evaluator = Evaluator(
        MLPTask(),
        mesh_of((8,), ("data",)),
        data_axes=("data",),
        global_batch_size=8,
        num_batches=1,
        seed=0,
    )
    with pytest.raises(RuntimeError, match="prepare"):
        evaluator.evaluate(None)


def test_a_task_with_model_state_is_evaluated_with_it():
    """A Flax NNX model with BatchNorm: the eval step reads the model state (and drops its
    update) in evaluation mode (running statistics); the sharded result equals the unsharded
    one, and differs from the training-mode loss."""
    pytest.importorskip("flax")
    import functools

    from trainers.core.model_state import loss_fn
    from trainers.tasks import nnx_models
    from trainers.tasks.flax_nnx import NNXTask
    from trainers.tasks.synthetic import TeacherRegression

    task = NNXTask(
        functools.partial(nnx_models.MLP, batch_norm=True),
        TeacherRegression(),
        logical_axis_rules={"embed": None, "mlp": "model"},
    )
    source = MLPTask()  # the same teacher: TeacherRegression's held-out split is its
    mesh = mesh_of((8,), ("data",))
    tx = xshard.cross_shard(optax.adam(3e-3), "mean")
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    state = trainer.init(*trainer.init_variables(next(iter(task.batches(BATCH, seed=0)))))
    assert jax.tree.leaves(state.model_state)  # BatchNorm statistics
    evaluator = build_evaluator(
        task, mesh, state, data_axes=("data",), opts=options(eval_batches=2), seed=0
    )
    got = evaluator.evaluate(state)
    params, model_state = jax.device_get((state.params, state.model_state))
    batches = [source.global_eval_batch(BATCH, seed=0, index=i) for i in range(2)]
    key = jax.random.key(0)
    evaluate = jax.jit(functools.partial(task.loss_with_state, train=False))
    losses = [float(evaluate(params, model_state, batch, key)[0]) for batch in batches]
    np.testing.assert_allclose(got["eval/loss"], np.mean(losses), rtol=1e-5)
    train_mode = [float(jax.jit(loss_fn(task))(params, model_state, b, key)[0]) for b in batches]
    assert abs(np.mean(train_mode) - np.mean(losses)) > 1e-4
