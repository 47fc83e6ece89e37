"""Exact evaluation: every example of a finite eval split scored once, the last batch padded
and masked (trainers/hooks/evaluation.py, eval_scoring.py, trainers/data/padding.py), checked
against a NumPy reference of the metrics on 8 simulated CPU devices."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh

import xshard
from trainers.config import TrainerOptions
from trainers.core.trainer import Trainer
from trainers.data.arrays import ArrayData
from trainers.data.padding import pad_rows, padding_like, row_layout
from trainers.hooks.eval_agreement import agreed_batches, one_process
from trainers.hooks.eval_scoring import accepts_mask
from trainers.hooks.evaluation import build_evaluator

EXAMPLES, BATCH, DIM, CLASSES = 359, 64, 5, 3


def mesh_of(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def dataset(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return {"x": x, "label": rng.integers(0, CLASSES, n).astype(np.int32)}


class Classifier:
    """A linear softmax classifier; its eval split is `EXAMPLES` examples in `ArrayData`."""

    sharding_rules = ()

    def __init__(self):
        self.train = ArrayData(dataset(512, 0), name="train")
        self.eval = ArrayData(dataset(EXAMPLES, 1), shuffle=False, name="eval")

    def init(self, rng, batch):
        return {"w": jax.random.normal(rng, (DIM, CLASSES)), "b": jnp.zeros((CLASSES,))}

    def per_example(self, params, batch):
        logits = batch["x"] @ params["w"] + params["b"]
        loss = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["label"][:, None], 1)[:, 0]
        return loss, (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)

    def loss(self, params, batch, rng):
        loss, correct = self.per_example(params, batch)
        return jnp.mean(loss), {"accuracy": jnp.mean(correct)}

    def batches(self, global_batch_size, **kwargs):
        return self.train.batches(global_batch_size, **kwargs)

    def eval_batches(self, global_batch_size, **kwargs):
        return self.eval.eval_batches(global_batch_size, **kwargs)


class LegacyMetrics(Classifier):
    """``eval_metrics(params, batch)`` without a mask: the contract before masks."""

    def eval_metrics(self, params, batch):
        loss, correct = self.per_example(params, batch)
        return {"loss": jnp.mean(loss), "accuracy": jnp.mean(correct)}


class MaskedMetrics(Classifier):
    """``eval_metrics(params, batch, *, mask)``: masked means over the batch."""

    def eval_metrics(self, params, batch, *, mask):
        loss, correct = self.per_example(params, batch)
        total = jnp.maximum(jnp.sum(mask), 1.0)
        return {"loss": jnp.sum(loss * mask) / total, "accuracy": jnp.sum(correct * mask) / total}


def numpy_reference(params) -> dict[str, float]:
    """Mean loss and accuracy over all `EXAMPLES` eval examples, in NumPy (float64)."""
    data = dataset(EXAMPLES, 1)
    w, b = (np.asarray(params[k], np.float64) for k in ("w", "b"))
    logits = data["x"].astype(np.float64) @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(EXAMPLES), data["label"]]
    correct = logits.argmax(axis=1) == data["label"]
    return {"eval/loss": float(loss.mean()), "eval/accuracy": float(correct.mean())}


@pytest.mark.parametrize("task_cls", [Classifier, LegacyMetrics, MaskedMetrics])
@pytest.mark.parametrize(("shape", "names"), [((8,), ("data",)), ((4, 2), ("data", "model"))])
def test_every_example_scored_once_matches_numpy(task_cls, shape, names):
    task = task_cls()
    mesh = mesh_of(shape, names)
    tx = xshard.cross_shard(optax.sgd(0.1), "mean")
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    state = trainer.init(trainer.init_params(next(task.batches(BATCH, seed=0))))
    opts = TrainerOptions(batch_size=BATCH, eval_batches=100)
    evaluator = build_evaluator(task, mesh, state, data_axes=("data",), opts=opts, seed=0)
    got = evaluator.evaluate(state)
    assert evaluator.count == -(-EXAMPLES // BATCH) == 6  # 5 full batches and 23 examples
    assert evaluator.examples == EXAMPLES
    want = numpy_reference(jax.device_get(state.params))
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], abs=1e-6), name


def test_eval_batches_cap_is_whole_batches():
    """``trainer.eval_batches`` still caps the batches: 2 of 64 score 128 examples."""
    task = Classifier()
    mesh = mesh_of((8,), ("data",))
    trainer = Trainer(task, xshard.cross_shard(optax.sgd(0.1), "mean"), mesh, global_batch_size=64)
    state = trainer.init(trainer.init_params(next(task.batches(64, seed=0))))
    opts = TrainerOptions(batch_size=64, eval_batches=2)
    evaluator = build_evaluator(task, mesh, state, data_axes=("data",), opts=opts, seed=0)
    evaluator.evaluate(state)
    assert (evaluator.count, evaluator.examples) == (2, 128)


@pytest.mark.parametrize("processes", [1, 2, 3, 4])
def test_one_pass_split_per_process_covers_every_example_once(processes):
    """`EpochData.eval_batches`: the processes' rows of each global batch, together, are every
    example once, and every process yields the same number of batches."""
    data = ArrayData({"i": np.arange(EXAMPLES)}, shuffle=True, name="eval")
    per_process = [
        list(data.eval_batches(48, seed=3, process_index=p, process_count=processes))
        for p in range(processes)
    ]
    assert {len(b) for b in per_process} == {-(-EXAMPLES // 48)}
    rows = np.concatenate([batch["i"] for batches in per_process for batch in batches])
    assert sorted(rows.tolist()) == list(range(EXAMPLES))


def test_padding_and_mask():
    batch, mask = pad_rows({"x": np.ones((3, 2), np.float32), "y": np.arange(3)}, 5)
    assert batch["x"].shape == (5, 2) and batch["y"].tolist() == [0, 1, 2, 0, 0]
    assert mask.tolist() == [1, 1, 1, 0, 0]
    empty, none = padding_like(batch, 4)
    assert empty["x"].shape == (4, 2) and not none.any()
    with pytest.raises(ValueError, match="larger than the batch size"):
        pad_rows({"x": np.ones((6,))}, 5)


def test_processes_agree_on_the_most_batches_and_the_padding_layout():
    """Each process hands `agreed_batches` its count and row layout; one with no eval batch
    pads batches laid out like another's (the values travel as JSON, as `Cluster.all_gather`
    carries them)."""
    first = {"x": np.ones((3, 2, 4), np.float16), "y": np.arange(3)}
    sent = [[5, row_layout(first)], [0, None]]  # process 0, process 1

    def all_gather(name, value):
        assert name == "eval/batches/1" and value in sent
        return json.loads(json.dumps(sent))

    most, batch = agreed_batches(5, first, all_gather=all_gather, name="eval/batches/1")
    assert most == 5 and batch is first
    most, empty = agreed_batches(0, None, all_gather=all_gather, name="eval/batches/1")
    assert most == 5 and empty is not None
    assert empty["x"].shape == (0, 2, 4) and empty["x"].dtype == np.float16
    assert empty["y"].shape == (0,) and empty["y"].dtype == np.arange(3).dtype
    padded, mask = padding_like(empty, 4)
    assert padded["x"].shape == (4, 2, 4) and not mask.any()
    assert agreed_batches(0, None, all_gather=one_process, name="n") == (0, None)


def test_accepts_mask():
    assert accepts_mask(MaskedMetrics().eval_metrics)
    assert not accepts_mask(LegacyMetrics().eval_metrics)
    assert accepts_mask(lambda params, batch, mask=None: {})
