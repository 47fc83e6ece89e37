"""Statistics of the gradient a step applies, on 8 simulated CPU devices, checked against
independent computations: per-layer norms and histograms, clipping statistics, the noise
scale's invariance, a plain optax optimizer, and the compilations a run needs."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import xshard
import xshard.stats.tree
from benchmarks.compile_events import CompileEvents
from tests.cross_shard_helpers import make_problem, mse
from trainers.core.trainer import Hook, Trainer
from trainers.tasks.mlp import MLPTask
from xshard.reduce.clipping import clip_by_global_norm
from xshard.stats.tree import path_str

pytestmark = pytest.mark.slow  # ~120 s of in-process compiles (make test runs them)

BATCH = 32
N = 8


@pytest.fixture(scope="module")
def task():
    return MLPTask()


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def batch(task):
    return next(iter(task.batches(BATCH, seed=0)))


@pytest.fixture(scope="module")
def params(task, mesh, batch):
    trainer = Trainer(task, optax.sgd(0.1), mesh, global_batch_size=BATCH)
    return jax.device_get(trainer.init_params(batch))


def one_step(task, mesh, tx, params, batch, **kwargs):
    """Metrics of one logging step (histograms) from `params` on `batch`."""
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH, **kwargs)
    _, metrics = trainer.step(trainer.init(params), batch, histograms=True)
    return dict(metrics), metrics.diagnostics


def shard_grads(task, params, batch):
    """Each shard's own gradient, computed on the host from its rows of the batch."""
    b = BATCH // N
    loss = lambda p, rows: task.loss(p, rows, None)[0]
    return [
        jax.grad(loss)(params, {k: v[i * b : (i + 1) * b] for k, v in batch.items()})
        for i in range(N)
    ]


def tree_norm(tree):
    return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


def clipped(tree, max_norm):
    norm = tree_norm(tree)
    return tree if norm < max_norm else jax.tree.map(lambda x: x * (max_norm / norm), tree)


def mean(trees):
    return jax.tree.map(lambda *xs: np.mean(xs, axis=0), *trees)


def leaf_norms(tree):
    return {
        path_str(p): float(np.linalg.norm(np.asarray(x).ravel()))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


# ------------------------------------------------------------------- per-layer statistics


@pytest.fixture(params=["whole", "split"])
def split(request, monkeypatch):
    """Per-leaf statistics read whole on every shard (mlp's size), or split over the shards
    (as for large models: `xshard.stats.tree.SPLIT_MIN_ELEMENTS`)."""
    if request.param == "split":
        split_all = {"sq_norms": 0, "histograms": 0}
        monkeypatch.setattr(xshard.stats.tree, "SPLIT_MIN_ELEMENTS", split_all)
    return request.param


def test_layer_norms_are_those_of_the_applied_gradient(task, mesh, params, batch, split):
    grads = shard_grads(task, params, batch)
    norms = sorted(tree_norm(g) for g in grads)
    max_norm = (norms[3] + norms[4]) / 2  # half of the shards are clipped
    expected_mean = leaf_norms(mean(grads))
    expected_clipped = leaf_norms(mean([clipped(g, max_norm) for g in grads]))

    _, mean_diag = one_step(task, mesh, xshard.cross_shard(optax.sgd(0.1), "mean"), params, batch)
    _, sum_diag = one_step(task, mesh, xshard.cross_shard(optax.sgd(0.1), "sum"), params, batch)
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", clip_per_shard=max_norm)
    _, clip_diag = one_step(task, mesh, tx, params, batch)

    assert mean_diag["grad_norms"].keys() == expected_mean.keys()
    for name, norm in expected_mean.items():
        np.testing.assert_allclose(mean_diag["grad_norms"][name], norm, rtol=1e-5)
        np.testing.assert_allclose(sum_diag["grad_norms"][name], N * norm, rtol=1e-5)
        np.testing.assert_allclose(clip_diag["grad_norms"][name], expected_clipped[name], rtol=1e-5)
    assert any(
        abs(clip_diag["grad_norms"][k] - v) > 1e-3 * v for k, v in expected_mean.items()
    )  # clipping changed the applied gradient, and the statistics saw it


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_statistics_steps_record_max_abs_and_leave_per_leaf_norms_to_logging_steps(
    task, mesh, params, batch, skip_nonfinite
):
    applied = mean(shard_grads(task, params, batch))
    max_abs = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(applied))
    tx = xshard.cross_shard(optax.sgd(0.1), "mean", skip_nonfinite=skip_nonfinite)
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    for layer_stats in (False, True):
        state, metrics = trainer.step(trainer.init(params), batch, layer_stats=layer_stats)
        reduced = jax.device_get(state.opt_state.reduced)
        np.testing.assert_allclose(metrics["grad/max_abs"], max_abs, rtol=1e-6)
        np.testing.assert_allclose(reduced.norm, tree_norm(applied), rtol=1e-5)
        if layer_stats:  # the per-leaf norms: a reduction per leaf, on logging steps only
            want = list(leaf_norms(applied).values())
            np.testing.assert_allclose(reduced.leaf_norms, want, rtol=1e-5)
        else:
            assert np.isnan(reduced.leaf_norms).all()
    state, metrics = trainer.step(trainer.init(params), batch, with_stats=False)
    assert np.isnan(jax.device_get(state.opt_state.reduced.max_abs))


def test_histograms_and_param_norms_describe_the_step(task, mesh, params, batch, split):
    lr = 0.1
    applied = mean(shard_grads(task, params, batch))
    new_params = jax.tree.map(lambda p, g: p - lr * g, params, applied)
    _, diag = one_step(task, mesh, xshard.cross_shard(optax.sgd(lr), "mean"), params, batch)
    for path, g in jax.tree_util.tree_leaves_with_path(applied):
        hist = diag["grad_hist"][path_str(path)]
        assert hist["num"] == hist["bucket_counts"].sum() == g.size
        np.testing.assert_allclose([hist["min"], hist["max"]], [g.min(), g.max()], rtol=1e-5)
        np.testing.assert_allclose(hist["sum_squares"], np.sum(np.square(g)), rtol=1e-4)
    for name, norm in leaf_norms(new_params).items():
        np.testing.assert_allclose(diag["param_norms"][name], norm, rtol=1e-5)


# ------------------------------------------------------------------- clipping statistics


def test_per_shard_clip_fraction_and_norms_before_clipping(task, mesh, params, batch):
    norms = sorted(tree_norm(g) for g in shard_grads(task, params, batch))
    for max_norm, fraction in (((norms[4] + norms[5]) / 2, 3 / 8), (10 * norms[-1], 0.0)):
        tx = xshard.cross_shard(optax.sgd(0.1), "mean", clip_per_shard=max_norm)
        metrics, _ = one_step(task, mesh, tx, params, batch)
        assert metrics["grad/shard_clip_fraction"] == pytest.approx(fraction)
        assert metrics["grad/shard_norm_max"] == pytest.approx(norms[-1], rel=1e-5)
        assert metrics["grad/shard_norm_min"] == pytest.approx(norms[0], rel=1e-5)
        assert metrics["grad/shard_norm_mean"] == pytest.approx(np.mean(norms), rel=1e-5)


def test_global_clip_statistics_when_it_fires_and_when_not(task, mesh, params, batch):
    reduced = tree_norm(mean(shard_grads(task, params, batch)))
    for max_norm, fired in ((reduced / 2, 1.0), (reduced * 2, 0.0)):
        tx = xshard.build_optimizer(
            {
                "optimizer": {"_target_": "optax.sgd", "learning_rate": 0.1},
                "reduction": {"mode": "mean"},
                "clip": max_norm,
            }
        )
        metrics, _ = one_step(task, mesh, tx, params, batch)
        assert metrics["grad/clip_fired"] == fired
        assert metrics["grad/global_norm"] == pytest.approx(reduced, rel=1e-5)
        assert metrics["grad/clipped_norm"] == pytest.approx(min(reduced, max_norm), rel=1e-5)
        # sgd(0.1) of the clipped gradient: the update is 0.1 x its norm.
        assert metrics["optim/update_norm"] == pytest.approx(0.1 * min(reduced, max_norm), 1e-4)


def test_recorded_global_clip_clips_like_optax():
    grads = {"w": np.array([3.0, 4.0], np.float32), "b": np.array([0.0], np.float32)}
    for max_norm in (1.0, 5.0, 10.0):
        ours, state = clip_by_global_norm(max_norm).update(grads, None)
        theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, None)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), ours, theirs)
        assert float(state.norm) == pytest.approx(5.0)
        assert float(state.clipped_norm) == pytest.approx(min(5.0, max_norm))
        assert float(state.fired) == (0.0 if max_norm > 5.0 else 1.0)


# ------------------------------------------------------------------- noise scale


def test_noise_scale_is_the_same_with_per_shard_clipping_sum_and_mean(task, mesh, params, batch):
    grads = shard_grads(task, params, batch)
    norms = sorted(tree_norm(g) for g in grads)
    small = np.mean([tree_norm(g) ** 2 for g in grads])
    big = tree_norm(mean(grads)) ** 2
    b, B = BATCH // N, BATCH
    trace = (small - big) / (1 / b - 1 / B)
    grad_sq = (B * big - b * small) / (B - b)

    runs = {}
    for mode in ("mean", "sum"):
        for clip in (None, (norms[3] + norms[4]) / 2):
            tx = xshard.cross_shard(optax.sgd(0.1), mode, clip_per_shard=clip)
            runs[mode, clip] = one_step(task, mesh, tx, params, batch)[0]
    for (mode, clip), metrics in runs.items():
        if clip is not None:
            assert metrics["grad/shard_clip_fraction"] == 0.5  # clipping did fire
        assert metrics["grad/noise_trace"] == pytest.approx(trace, rel=1e-4), (mode, clip)
        assert metrics["grad/noise_grad_sq"] == pytest.approx(grad_sq, rel=1e-4), (mode, clip)
        assert metrics["grad/noise_scale"] == pytest.approx(trace / grad_sq, rel=1e-4)


def test_noise_terms_do_not_depend_on_shard_weight(mesh):
    params, batch = make_problem()

    def shard_stats(weighted):
        tx = xshard.cross_shard(optax.sgd(0.1), "mean")

        def body(params, batch):
            local = jax.lax.pcast(params, "data", to="varying")
            grads = jax.grad(mse)(local, batch)
            extra = {"shard_weight": jax.lax.axis_index("data") + 1.0} if weighted else {}
            return tx.update(grads, tx.init(params), params, **extra)[1].shards

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        return jax.device_get(jax.jit(fn)(params, batch))

    plain, weighted = shard_stats(False), shard_stats(True)
    for field in ("sq_norm_mean", "mean_sq_norm", "norm_mean", "norm_max"):
        assert getattr(weighted, field) == pytest.approx(getattr(plain, field), rel=1e-5)


# ------------------------------------------------------------------- plain optax optimizer


class Recorder(Hook):
    def __init__(self, trainer=None):
        self.metrics, self.diagnostics, self.compiled_at = {}, {}, {}
        self.trainer = trainer

    def on_step(self, step, metrics):
        self.metrics[step] = metrics
        if self.trainer is not None:  # the executables that existed at this step's end
            self.compiled_at[step] = list(self.trainer.executables())

    def on_diagnostics(self, step, diag):
        self.diagnostics[step] = diag


def fit(task, mesh, tx, steps=6, **kwargs):
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH, **kwargs)
    first = next(iter(task.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(first))
    rec = Recorder(trainer)
    with CompileEvents() as events:
        result = trainer.fit(
            state,
            task.batches(BATCH, seed=0),
            num_steps=steps,
            hooks=[rec],
            stats_every=2,
            layer_stats_every=3,
            histogram_every=4,
        )
        state, reason = result.state, result.reason
    assert reason == "done"
    return jax.device_get(state.params), rec, trainer, events


@pytest.mark.parametrize("grad_impl", ["manual", "gspmd"])
def test_plain_optax_optimizer_trains_like_cross_shard_mean(task, mesh, grad_impl):
    plain, rec, _, _ = fit(task, mesh, optax.adam(1e-3), grad_impl=grad_impl)
    wrapped, ref, _, _ = fit(task, mesh, xshard.cross_shard(optax.adam(1e-3)), grad_impl=grad_impl)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), plain, wrapped
    )
    assert rec.metrics[6]["train/loss"] < rec.metrics[1]["train/loss"]
    stats = {"grad/global_norm", "optim/update_norm", "grad/max_abs", "train/loss"}
    if grad_impl == "manual":
        stats |= {"grad/shard_norm_mean", "grad/noise_scale"}
    assert stats <= rec.metrics[6].keys()
    assert "train/skipped_steps" not in rec.metrics[6]  # a plain optimizer skips nothing
    for tag in stats - {"grad/noise_scale"}:
        assert rec.metrics[6][tag] == pytest.approx(ref.metrics[6][tag], rel=1e-4)
    assert rec.diagnostics.keys() == {3, 4, 6}
    assert rec.diagnostics[4]["grad_norms"] == pytest.approx(ref.diagnostics[4]["grad_norms"])


# ------------------------------------------------------------------- compilations


def test_every_program_the_run_needs_is_compiled_once_before_the_first_step(task, mesh):
    _, rec, trainer, events = fit(task, mesh, xshard.cross_shard(optax.adam(1e-3)), steps=8)
    # One executable per level the run meets (steps 1-4 meet levels 0-3), all compiled ahead
    # of step 1, so no step after the first waits on a compile.
    assert list(trainer.executables()) == [0, 1, 2, 3]
    assert {step: sorted(levels) for step, levels in rec.compiled_at.items()} == {
        s: [0, 1, 2, 3] for s in range(1, 9)
    }
    assert events.compiles == 4 and events.traces == 4
    assert {s for s, m in rec.metrics.items() if "optim/update_norm" in m} == {2, 3, 4, 6, 8}
    assert rec.diagnostics.keys() == {3, 4, 6, 8}
    assert {s for s, d in rec.diagnostics.items() if "grad_hist" in d} == {4, 8}


def test_a_run_compiles_only_the_levels_it_meets(task, mesh):
    tx = xshard.cross_shard(optax.adam(1e-3))
    trainer = Trainer(task, tx, mesh, global_batch_size=BATCH)
    first = next(iter(task.batches(BATCH, seed=0)))
    state = trainer.init(trainer.init_params(first))
    with CompileEvents() as events:  # statistics every 5th step, no logging steps
        trainer.fit(state, task.batches(BATCH, seed=0), num_steps=10, stats_every=5)
    assert list(trainer.executables()) == [0, 1]
    assert events.compiles == 2
