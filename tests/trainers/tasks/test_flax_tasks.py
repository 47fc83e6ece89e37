"""Flax NNX and linen models as tasks, in-process on 8 simulated CPU devices.

They train like the same model written in pure JAX; BatchNorm statistics are those of the
global batch on every shard; logical axis names give the expected shardings on a 4x2 mesh.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import xshard
from trainers.core.model_state import loss_fn
from trainers.core.trainer import Trainer
from trainers.tasks.mlp import MLPTask
from trainers.tasks.synthetic import TeacherRegression
from xshard.errors import ConfigError

pytest.importorskip("flax")

from trainers.tasks import linen_models, nnx_models
from trainers.tasks.flax_linen import LinenTask
from trainers.tasks.flax_nnx import NNXTask

pytestmark = pytest.mark.long

BATCH = 32
RULES = {"embed": None, "mlp": "model"}


def mesh_of(shape, names):
    n = int(np.prod(shape))
    devices = np.array(jax.devices()[:n]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def nnx_task(**model):
    return NNXTask(
        functools.partial(nnx_models.MLP, **model), TeacherRegression(), logical_axis_rules=RULES
    )


def linen_task(**model):
    return LinenTask(
        linen_models.MLP(**model), TeacherRegression(), logical_axis_rules=RULES, train_arg="train"
    )


def make_trainer(task, mesh, **kwargs):
    tx = xshard.cross_shard(optax.adam(3e-3), "mean")
    return Trainer(task, tx, mesh, global_batch_size=BATCH, **kwargs)


def fit(trainer, task, state, steps):
    result = trainer.fit(state, task.batches(BATCH, seed=0), num_steps=steps)
    state, reason = result.state, result.reason
    assert reason == "done"
    return state


def first_batch(task):
    return next(iter(task.batches(BATCH, seed=0)))


# --------------------------------------------------------------------------------------------
# The same model in pure JAX
# --------------------------------------------------------------------------------------------


class FromParams(MLPTask):
    """task=mlp's model and data, initialised from given params (the Flax model's)."""

    def __init__(self, params):
        super().__init__()
        self._params = params

    def init(self, rng, batch):
        return self._params


def as_mlp_params(params, kind):
    """The Flax MLP's params in task=mlp's layout ({"layers": [{"w", "b"}, ...]})."""
    n = len(params["layers"]) if kind == "nnx" else len(params)
    layers = [
        params["layers"][str(i)] if kind == "nnx" else params[f"layers_{i}"] for i in range(n)
    ]
    return {"layers": [{"w": p["kernel"], "b": p["bias"]} for p in layers]}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
@pytest.mark.parametrize("grad_impl", ["manual", "gspmd"])
def test_flax_model_trains_like_the_same_model_in_pure_jax(kind, grad_impl):
    mesh = mesh_of((8,), ("data",))
    task = nnx_task() if kind == "nnx" else linen_task()
    trainer = make_trainer(task, mesh, grad_impl=grad_impl)
    params, model_state = trainer.init_variables(first_batch(task))
    init = as_mlp_params(jax.device_get(params), kind)
    flax_state = fit(trainer, task, trainer.init(params, model_state), steps=5)

    reference = FromParams(init)
    ref_trainer = make_trainer(reference, mesh, grad_impl=grad_impl)
    ref_params = ref_trainer.init_params(first_batch(reference))
    ref_state = fit(ref_trainer, reference, ref_trainer.init(ref_params), steps=5)

    got = as_mlp_params(jax.device_get(flax_state.params), kind)
    want = jax.device_get(ref_state.params)
    assert not np.allclose(got["layers"][0]["w"], init["layers"][0]["w"])  # it trained
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


# --------------------------------------------------------------------------------------------
# BatchNorm statistics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_batch_norm_statistics_are_the_global_batchs_on_every_shard(kind):
    mesh = mesh_of((8,), ("data",))
    task = (nnx_task if kind == "nnx" else linen_task)(batch_norm=True)
    trainer = make_trainer(task, mesh)
    batch = first_batch(task)
    params, model_state = trainer.init_variables(batch)
    start = jax.device_get((params, model_state))
    state = fit(trainer, task, trainer.init(params, model_state), steps=1)

    # The same forward pass on the whole batch, on one device, without shards.
    rng = jax.random.fold_in(jax.random.key(0), 0)  # unused by a model without dropout
    _, _, full = jax.jit(loss_fn(task))(*start, batch, rng)
    for leaf, want in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(full)):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])  # identical on every shard
        np.testing.assert_allclose(shards[0], want, rtol=1e-5, atol=1e-6)  # = full batch
    moved = jax.tree.map(lambda a, b: not np.allclose(a, b), start[1], jax.device_get(full))
    assert all(jax.tree.leaves(moved))  # the statistics did change


def test_without_sync_the_shard_average_of_variances_is_not_the_global_variance():
    """What `sync_batch_norm` is for: averaging per-shard statistics gets the mean right but
    not the variance (it misses the spread of the shard means)."""
    mesh = mesh_of((8,), ("data",))
    task = NNXTask(
        functools.partial(nnx_models.MLP, batch_norm=True),
        TeacherRegression(),
        logical_axis_rules=RULES,
        sync_batch_norm=False,
    )
    trainer = make_trainer(task, mesh)
    batch = first_batch(task)
    params, model_state = trainer.init_variables(batch)
    start = jax.device_get((params, model_state))
    state = fit(trainer, task, trainer.init(params, model_state), steps=1)
    _, _, full = jax.jit(loss_fn(task))(*start, batch, jax.random.key(0))
    got, want = jax.device_get(state.model_state["norms"]["0"]), full["norms"]["0"]
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["var"], want["var"], rtol=1e-5, atol=1e-6)


def test_dropout_rng_counters_are_carried_and_identical_on_every_shard():
    mesh = mesh_of((8,), ("data",))
    task = nnx_task(dropout=0.1)
    trainer = make_trainer(task, mesh)
    params, model_state = trainer.init_variables(first_batch(task))
    key0 = np.asarray(jax.device_get(model_state["dropout"]["rngs"]["key"]))
    state = fit(trainer, task, trainer.init(params, model_state), steps=3)
    rngs = jax.device_get(state.model_state["dropout"]["rngs"])
    assert int(rngs["count"]) == 3 * 2  # two dropout layers called per step
    np.testing.assert_array_equal(rngs["key"], key0)  # the model's own key is kept


# --------------------------------------------------------------------------------------------
# Logical sharding
# --------------------------------------------------------------------------------------------

#: task=mlp's Megatron-style rules over `model`, by the Flax MLP's parameter paths.
EXPECTED = {
    "0/kernel": P(None, "model"),
    "0/bias": P("model"),
    "1/kernel": P(None, "model"),
    "1/bias": P("model"),
    "2/kernel": P("model", None),
    "2/bias": P(None),
}


@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_logical_axis_rules_give_the_expected_shardings_on_cpu4x2(kind):
    mesh = mesh_of((4, 2), ("data", "model"))
    task = nnx_task() if kind == "nnx" else linen_task()
    trainer = make_trainer(task, mesh)
    state = trainer.init(*trainer.init_variables(first_batch(task)))
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
    }
    prefix = "layers/" if kind == "nnx" else "layers_"
    assert {k: flat[prefix + k] for k in EXPECTED} == EXPECTED
    kernel = state.params["layers"]["0"]["kernel"] if kind == "nnx" else None
    if kernel is not None:
        assert kernel.addressable_shards[0].data.shape == (16, 32)  # 64 hidden units over 2
    # Optimizer slots follow their params.
    state = fit(trainer, task, state, steps=1)
    assert flat == {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf.sharding.spec
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
    }


def test_rules_over_mesh_axes_the_mesh_lacks_replicate():
    mesh = mesh_of((8,), ("data",))
    task = nnx_task()
    trainer = make_trainer(task, mesh)
    params, _ = trainer.init_variables(first_batch(task))
    specs = {leaf.sharding.spec for leaf in jax.tree.leaves(params)}
    assert all(all(e is None for e in spec) for spec in specs)


def test_unknown_logical_name_is_an_error_listing_the_known_ones():
    task = NNXTask(
        functools.partial(nnx_models.MLP), TeacherRegression(), logical_axis_rules={"mlp": "model"}
    )
    trainer = make_trainer(task, mesh_of((4, 2), ("data", "model")))
    with pytest.raises(ConfigError) as e:
        trainer.init_variables(first_batch(task))
    message = str(e.value)
    assert "task.logical_axis_rules has no rule for the logical axis 'embed'" in message
    assert "rules for ['mlp']" in message and "the model uses ['embed', 'mlp']" in message


@pytest.mark.parametrize("rules", [["mlp"], {"mlp": 3}, {"mlp": [None]}])
def test_bad_logical_axis_rules_are_config_errors(rules):
    with pytest.raises(ValueError, match="task.logical_axis_rules"):
        NNXTask(functools.partial(nnx_models.MLP), TeacherRegression(), logical_axis_rules=rules)


# --------------------------------------------------------------------------------------------
# Config: nested targets, the allowlist, imports
# --------------------------------------------------------------------------------------------


def test_the_model_node_is_built_under_the_allowlist(compose_config):
    from trainers.app.builders import build_task

    task = build_task(compose_config("task=flax_nnx", "task.model.hidden=[8]"))
    assert isinstance(task, NNXTask) and isinstance(task.model, functools.partial)
    assert task.model.func is nnx_models.MLP and task.model.keywords["hidden"] == [8]
    assert isinstance(task.data, TeacherRegression)
    linen = build_task(compose_config("task=flax_linen", "task.model.hidden=[8]"))
    assert isinstance(linen.model, linen_models.MLP) and linen.model.hidden == [8]


EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

class Model:
    def __init__(self, **kwargs):
        pass
"""


@pytest.mark.parametrize("node", ["task.model", "task.data"])
def test_a_nested_target_outside_the_allowlist_is_refused_before_import(
    compose_config, tmp_path, monkeypatch, node
):
    from trainers.app.builders import build_task

    marker = tmp_path / "imported.txt"
    (tmp_path / "xs_evil_models.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_config("task=flax_nnx", f"{node}._target_=xs_evil_models.Model")
    with pytest.raises(ConfigError) as e:
        build_task(cfg)
    assert str(e.value).startswith(
        f"{node}._target_='xs_evil_models.Model' is not an allowed target"
    )
    assert not marker.exists() and "xs_evil_models" not in sys.modules


def test_importing_the_trainer_does_not_import_flax():
    probe = (
        "import sys, xshard, trainers.train, trainers.core.trainer, trainers.tasks\n"
        "print('flax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# The CLI, end to end, with resume
# --------------------------------------------------------------------------------------------


def _checkpoint_arrays(step_dir):
    """Every array of a checkpoint's state, by path (Orbax's own reader, no target)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as reader:
        tree = reader.restore(step_dir / "state")
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.slow
@pytest.mark.parametrize("task", ["flax_nnx", "flax_linen"])
def test_cli_trains_a_flax_task_and_resumes_bitwise(tmp_path, task):
    from tests.cli import run_train, scalars

    common = (
        f"task={task}",
        "mesh=cpu4x2",
        "schedule=constant",
        "trainer.batch_size=16",
        "checkpoint.every_steps=3",
        "checkpoint.async_save=false",
        "trainer.log_every=1",
        "task.model.batch_norm=true",
        "task.model.dropout=0.1",
    )
    run_train(*common, "trainer.steps=6", f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path)
    run_train(*common, "trainer.steps=3", f"hydra.run.dir={tmp_path / 'parts'}", cwd=tmp_path)
    run_train(*common, "trainer.steps=6", f"hydra.run.dir={tmp_path / 'parts'}", cwd=tmp_path)

    whole = _checkpoint_arrays(tmp_path / "whole" / "checkpoints" / "6")
    parts = _checkpoint_arrays(tmp_path / "parts" / "checkpoints" / "6")
    assert whole.keys() == parts.keys()
    stats = [k for k in whole if "model_state" in k]
    assert any("mean" in k for k in stats) and any("var" in k for k in stats)
    for k in whole:
        np.testing.assert_array_equal(parts[k], whole[k], err_msg=k)
    losses = {}  # the two runs of `parts` log under two names (their overrides differ)
    for run in (tmp_path / "parts" / "tb").iterdir():
        losses |= scalars(run, "train/loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
