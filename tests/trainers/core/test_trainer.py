"""trainers.Trainer in-process on 8 simulated CPU devices: equivalences and sharding."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import xshard
from tests.cli import load_events
from trainers.core.step.levels import LAYERS, PLAIN, STATS
from trainers.core.trainer import Hook, Trainer
from trainers.hooks.logged_scalars import LoggedScalars, ScalarOptions
from trainers.hooks.run_logger import LoggerHook, RunInfo
from trainers.hooks.summary import RunSummary
from trainers.hooks.tensorboard import TensorBoardSink
from trainers.tasks.mlp import MLPTask
from trainers.tasks.tiny_gpt import TinyGPTTask

BATCH = 32


def mesh_of(shape, names):
    n = int(np.prod(shape))
    return Mesh(
        np.array(jax.devices()[:n]).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape)
    )


class Recorder(Hook):
    def __init__(self):
        self.metrics = {}
        self.diagnostics = {}

    def on_step(self, step, metrics):
        self.metrics[step] = metrics

    def on_diagnostics(self, step, diag):
        self.diagnostics[step] = diag


def train(task, mesh, *, steps=8, reduction="mean", batch=BATCH, stats_every=1, **kwargs):
    tx = xshard.cross_shard(
        optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), reduction, skip_nonfinite=True
    )
    trainer = Trainer(task, tx, mesh, global_batch_size=batch, reduction=reduction, **kwargs)
    first = next(iter(task.batches(batch, seed=0)))
    state = trainer.init(trainer.init_params(first))
    rec = Recorder()
    result = trainer.fit(
        state, task.batches(batch, seed=0), num_steps=steps, hooks=[rec], stats_every=stats_every
    )
    state, reason = result.state, result.reason
    assert reason == "done"
    losses = np.array([rec.metrics[s]["train/loss"] for s in range(1, steps + 1)])
    return jax.device_get(state.params), losses, rec, trainer


@pytest.fixture(scope="module")
def mlp():
    return MLPTask()


@pytest.fixture(scope="module")
def reference(mlp):
    """Manual reduction, MEAN, 8 shards, one microbatch."""
    return train(mlp, mesh_of((8,), ("data",)))


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def test_manual_and_gspmd_gradients_train_the_same(mlp, reference):
    params, losses, _, _ = train(mlp, mesh_of((8,), ("data",)), grad_impl="gspmd")
    np.testing.assert_allclose(losses, reference[1], rtol=1e-5)
    assert_close(params, reference[0])


def test_microbatches_accumulate_to_the_same_update(mlp, reference):
    params, losses, _, _ = train(mlp, mesh_of((8,), ("data",)), microbatches=4)
    np.testing.assert_allclose(losses, reference[1], rtol=1e-5)
    assert_close(params, reference[0])


def test_mean_on_8_shards_trains_like_one_device(mlp, reference):
    params, losses, _, _ = train(mlp, mesh_of((1,), ("data",)))
    np.testing.assert_allclose(losses, reference[1], rtol=1e-5)
    assert_close(params, reference[0])
    assert losses[-1] < losses[0]


def test_sum_reduced_gradient_is_8_times_mean_at_the_first_step(mlp, reference):
    _, _, rec, _ = train(mlp, mesh_of((8,), ("data",)), steps=1, reduction="sum")
    mean_norm = reference[2].metrics[1]["grad/global_norm"]
    np.testing.assert_allclose(rec.metrics[1]["grad/global_norm"], 8 * mean_norm, rtol=1e-6)


def test_statistics_are_consistent(reference):
    m = reference[2].metrics[1]
    assert m["grad/shard_norm_min"] <= m["grad/shard_norm_mean"] <= m["grad/shard_norm_max"]
    # The mean of 8 shard gradients is never longer than the longest of them.
    assert m["grad/global_norm"] <= m["grad/shard_norm_max"] + 1e-6
    assert m["grad/nonfinite"] == 0 and m["train/skipped_steps"] == 0
    assert m["optim/learning_rate"] == pytest.approx(3e-3)
    assert np.isfinite(m["grad/noise_trace"]) and m["grad/noise_trace"] > 0


def test_logging_step_gives_per_parameter_norms_and_histograms(mlp):
    mesh = mesh_of((8,), ("data",))
    tx = xshard.cross_shard(optax.sgd(0.1), "mean")
    trainer = Trainer(mlp, tx, mesh, global_batch_size=BATCH)
    batch = next(iter(mlp.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(batch))
    grads = jax.grad(lambda p: mlp.loss(p, batch, None)[0])(jax.device_get(state.params))
    _, metrics = trainer.step(state, batch, histograms=True)
    (vector,) = jax.tree.leaves(metrics)  # metrics and per-layer statistics: one transfer
    assert vector.ndim == 1 and vector.size > len(dict(metrics))
    diag = metrics.diagnostics
    expected = {
        xshard.stats.tree.path_str(k): np.linalg.norm(v)
        for k, v in jax.tree_util.tree_leaves_with_path(grads)
    }
    assert diag["grad_norms"].keys() == expected.keys()
    for name, norm in expected.items():
        np.testing.assert_allclose(diag["grad_norms"][name], norm, rtol=1e-4)
        hist = diag["grad_hist"][name]
        assert hist["bucket_counts"].sum() == hist["num"] == grads_size(grads, name)


def grads_size(grads, name):
    return {
        xshard.stats.tree.path_str(k): v.size for k, v in jax.tree_util.tree_leaves_with_path(grads)
    }[name]


def test_batch_not_divisible_by_data_parallel_size_is_a_clear_error(mlp):
    with pytest.raises(
        ValueError, match=r"trainer.batch_size=30 is not divisible by the data-parallel size 8"
    ):
        Trainer(
            mlp, xshard.cross_shard(optax.sgd(0.1)), mesh_of((8,), ("data",)), global_batch_size=30
        )
    with pytest.raises(ValueError, match=r"trainer.microbatches=3"):
        Trainer(
            mlp,
            xshard.cross_shard(optax.sgd(0.1)),
            mesh_of((8,), ("data",)),
            global_batch_size=32,
            microbatches=3,
        )


def test_a_plain_optax_optimizer_is_wrapped_once_in_cross_shard(mlp):
    mesh = mesh_of((8,), ("data",))
    trainer = Trainer(mlp, optax.sgd(0.1), mesh, global_batch_size=BATCH, reduction="SUM")
    spec = trainer.tx.spec  # what the step runs: a cross_shard over the data axes
    assert isinstance(trainer.tx, xshard.CrossShardTransformation)
    assert spec.reduction is xshard.Reduction.SUM and spec.axis_name == ("data",)
    assert not spec.skip_nonfinite  # a plain optimizer skips nothing
    tx = xshard.cross_shard(optax.sgd(0.1), "mean")
    assert Trainer(mlp, tx, mesh, global_batch_size=BATCH, reduction="MEAN").tx is tx
    with pytest.raises(ValueError, match="reduction='sum' disagrees with the optimizer's 'mean'"):
        Trainer(mlp, tx, mesh, global_batch_size=BATCH, reduction="sum")


def test_a_cross_shard_inside_a_chain_is_refused_before_anything_compiles(mlp):
    tx = optax.chain(xshard.cross_shard(optax.sgd(0.1)), optax.scale(0.5))
    trainer = Trainer(mlp, tx, mesh_of((8,), ("data",)), global_batch_size=BATCH)
    params = trainer.init_params(next(iter(mlp.batches(BATCH, seed=0))))
    with pytest.raises(ValueError, match=r"inside another transformation .* every gradient twice"):
        trainer.init(params)
    assert trainer.executables() == {}


def test_tiny_gpt_on_data_x_model_mesh_shards_params_over_model():
    task = TinyGPTTask(d_model=32, n_heads=2, n_layers=1, d_ff=64, seq_len=16)
    mesh = mesh_of((4, 2), ("data", "model"))
    _, losses, _, trainer = train(task, mesh, steps=6, batch=16)
    assert losses[-1] < losses[0]
    first = next(iter(task.batches(16, seed=0)))
    state = trainer.init(trainer.init_params(first))
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
    assert specs["blocks"][0]["attn"]["wq"] == P(None, "model")
    assert specs["blocks"][0]["attn"]["wo"] == P("model", None)
    assert specs["blocks"][0]["mlp"]["w1"] == P(None, "model")
    assert specs["ln_f"]["scale"] == P()
    wq = state.params["blocks"][0]["attn"]["wq"]
    assert wq.addressable_shards[0].data.shape == (32, 16)  # half of d_model=32 columns
    # The optimizer state follows the params' sharding.
    mu = xshard.get_slot(state.opt_state, "mu")
    assert mu["blocks"][0]["attn"]["wq"].sharding.spec == P(None, "model")


def test_statistics_every_k_steps_share_one_executable_and_match(mlp, reference):
    _, losses, rec, trainer = train(mlp, mesh_of((8,), ("data",)), stats_every=3)
    np.testing.assert_allclose(losses, reference[1], rtol=1e-6)
    for step, metrics in rec.metrics.items():
        has_stats = step in (3, 6, 8)  # every 3rd and the last
        assert ("grad/shard_norm_mean" in metrics) == has_stats
        assert ("optim/update_norm" in metrics) == has_stats
        assert ("grad/global_norm" in metrics) == has_stats
        assert {"grad/max_abs", "grad/nonfinite", "train/skipped_steps"} <= metrics.keys()
        if has_stats:
            for tag in (
                "grad/global_norm",
                "grad/shard_norm_max",
                "optim/update_norm",
                "params/global_norm",
            ):
                np.testing.assert_allclose(metrics[tag], reference[2].metrics[step][tag], rtol=1e-5)
    assert trainer.compiled is not None


def test_tensorboard_gets_every_tag_of_each_logging_step_in_one_event(mlp, tmp_path):
    steps, every = 8, 3
    scalars = LoggedScalars(
        ScalarOptions(log_every=every, num_steps=steps, global_batch_size=BATCH)
    )
    sinks = [TensorBoardSink(str(tmp_path), flush_secs=10)]
    tb = LoggerHook(sinks, RunInfo(), scalars, RunSummary())
    tx = xshard.cross_shard(optax.adam(3e-3), "mean", skip_nonfinite=True)
    trainer = Trainer(mlp, tx, mesh_of((8,), ("data",)), global_batch_size=BATCH)
    first = next(iter(mlp.batches(BATCH, seed=0)))
    rec = Recorder()
    result = trainer.fit(
        trainer.init(trainer.init_params(first)),
        mlp.batches(BATCH, seed=0),
        num_steps=steps,
        hooks=[rec, tb],
        stats_every=2,
        layer_stats_every=every,
    )
    reason = result.reason
    assert reason == "done"
    events = load_events(tmp_path)
    logged = (3, 6, 8)  # every 3rd step and the last
    for step, metrics in rec.metrics.items():
        for tag, value in metrics.items():
            if tag == "perf/compile_time_s":
                continue  # written at the first step, logged or not
            points = {e.step: e.value for e in events.Scalars(tag)}
            if step in logged and (tag != "grad/noise_scale" or np.isfinite(value)):
                np.testing.assert_allclose(points[step], value, rtol=1e-6)
            else:
                assert step not in points, (tag, step)
    for step in logged:
        for tag in ("perf/steps_per_sec", "perf/examples_per_sec"):
            assert step in {e.step for e in events.Scalars(tag)}
    for step, diag in rec.diagnostics.items():
        assert step in (3, 6)
        for name, value in diag["grad_norms"].items():
            points = {e.step: e.value for e in events.Scalars(f"layers/grad_norm/{name}")}
            np.testing.assert_allclose(points[step], value, rtol=1e-6)
    # The scalars of a logging step are one event: one wall time (the per-layer norms another).
    for step in logged:
        times = {
            e.wall_time
            for tag in events.Tags()["scalars"]
            if not tag.startswith(("layers/", "hparams/", "perf/compile"))
            for e in events.Scalars(tag)
            if e.step == step
        }
        assert len(times) == 1, (step, times)


@pytest.mark.parametrize("compile_ahead", [True, False])
def test_fit_compiles_the_programs_of_its_run_before_the_first_step(mlp, compile_ahead):
    """Every program the run meets (plain, statistics at 4 and the last, per-layer at 3)
    is compiled before step 1 and its time reported there; lazily, each step that first
    needs a program compiles it."""
    tx = xshard.cross_shard(optax.adam(3e-3), "mean", skip_nonfinite=True)
    trainer = Trainer(mlp, tx, mesh_of((8,), ("data",)), global_batch_size=BATCH)
    first = next(iter(mlp.batches(BATCH, seed=0)))
    rec = Recorder()
    trainer.fit(
        trainer.init(trainer.init_params(first)),
        mlp.batches(BATCH, seed=0),
        num_steps=6,
        hooks=[rec],
        stats_every=4,
        layer_stats_every=3,
        compile_ahead=compile_ahead,
    )
    compiled_at = [s for s, m in sorted(rec.metrics.items()) if "perf/compile_time_s" in m]
    assert compiled_at == ([1] if compile_ahead else [1, 3, 4])
    assert sorted(trainer.executables()) == [PLAIN, STATS, LAYERS]
