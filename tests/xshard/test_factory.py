"""xshard.build_optimizer / build_schedule from plain configs: wiring, allowlist, clear errors."""

from __future__ import annotations

import copy
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from omegaconf import OmegaConf

import xshard
from xshard import ConfigError
from xshard.optim.cross_shard import CrossShardState


def make_cfg(**sections):
    """A minimal config: sgd(lr=1), mean over `data`, no schedule, no clip; `sections` override."""
    cfg = {
        "optimizer": {"_target_": "optax.sgd", "learning_rate": 1.0},
        "reduction": {"mode": "mean"},
        "schedule": None,
        "clip": None,
    }
    cfg.update(copy.deepcopy(sections))
    return cfg


PARAMS = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_builds_from_dict_and_dictconfig():
    for cfg in (make_cfg(), OmegaConf.create(make_cfg())):
        tx = xshard.build_optimizer(cfg)
        assert isinstance(tx, optax.GradientTransformationExtraArgs)
        state = tx.init(PARAMS)
        assert isinstance(state, CrossShardState)


def test_only_needed_nodes_are_resolved():
    # ${hydra:...} cannot resolve outside a Hydra app; it must not matter to the factory.
    cfg = OmegaConf.create({**make_cfg(), "paths": {"out": "${hydra:runtime.output_dir}"}})
    xshard.build_optimizer(cfg).init(PARAMS)


# --------------------------------------------------------------------------------------------
# The learning rate is readable from the state
# --------------------------------------------------------------------------------------------


def test_constant_learning_rate_in_state():
    tx = xshard.build_optimizer(
        make_cfg(optimizer={"_target_": "optax.adam", "learning_rate": 3e-4})
    )
    state = tx.init(PARAMS)
    assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(3e-4)
    assert float(
        optax.tree_utils.tree_get(xshard.inner_state(state), "learning_rate")
    ) == pytest.approx(3e-4)
    assert xshard.get_slot_names(state) == ["mu", "nu"]


def test_scheduled_learning_rate_in_state_follows_schedule():
    cfg = make_cfg(
        optimizer={
            "_target_": "optax.adamw",
            "learning_rate": 1.0,
            "weight_decay_mask": "no_bias_no_norm",
        },
        schedule={
            "_target_": "xshard.schedules.warmup_linear",
            "warmup_steps": 2,
            "decay_steps": 6,
        },
        clip=1.0,
    )
    tx = xshard.build_optimizer(cfg)
    schedule = xshard.build_schedule(cfg)
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    seen = [float(optax.tree_utils.tree_get(state, "learning_rate"))]
    for _ in range(6):
        _, state = update(grads, state, PARAMS)
        seen.append(float(optax.tree_utils.tree_get(state, "learning_rate")))
    # After init: the rate of step 0; after update k: the rate that update used, schedule(k-1).
    np.testing.assert_allclose(seen, [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25], atol=1e-6)
    np.testing.assert_allclose(
        [float(schedule(k)) for k in range(7)], [0, 0.5, 1, 0.75, 0.5, 0.25, 0], atol=1e-6
    )
    assert float(xshard.get_hyperparams(state)["learning_rate"]) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ({"_target_": "xshard.schedules.constant"}, {0: 2.0, 50: 2.0}),
        ({"_target_": "xshard.schedules.cosine", "decay_steps": 10}, {0: 2.0, 5: 1.0, 10: 0.0}),
        (
            {
                "_target_": "xshard.schedules.warmup_cosine",
                "warmup_steps": 4,
                "decay_steps": 14,
                "end_factor": 0.1,
            },
            {0: 0.0, 2: 1.0, 4: 2.0, 9: 1.1, 14: 0.2, 20: 0.2},
        ),
        (
            {
                "_target_": "xshard.schedules.warmup_linear",
                "warmup_steps": 2,
                "decay_steps": 6,
                "init_factor": 0.5,
            },
            {0: 1.0, 1: 1.5, 2: 2.0, 4: 1.0, 6: 0.0},
        ),
        (
            {
                "_target_": "xshard.schedules.exponential",
                "transition_steps": 10,
                "decay_rate": 0.5,
                "warmup_steps": 2,
                "end_factor": 0.3,
            },
            {0: 0.0, 1: 1.0, 2: 2.0, 12: 1.0, 100: 0.6},
        ),
        (  # an optax schedule: the base rate goes to its first argument, init_value
            {"_target_": "optax.cosine_decay_schedule", "decay_steps": 10},
            {0: 2.0, 5: 1.0, 10: 0.0},
        ),
        (  # warmup longer than the run: warmup only, no error
            {"_target_": "xshard.schedules.warmup_cosine", "warmup_steps": 30, "decay_steps": 5},
            {0: 0.0, 3: 0.2, 30: 2.0},
        ),
    ],
    ids=lambda v: (
        v["_target_"].rsplit(".", 1)[-1] if isinstance(v, dict) and "_target_" in v else None
    ),
)
def test_build_schedule_values(schedule, expected):
    fn = xshard.build_schedule(
        make_cfg(optimizer={"_target_": "optax.sgd", "learning_rate": 2.0}, schedule=schedule)
    )
    for step, value in expected.items():
        assert float(fn(step)) == pytest.approx(value, abs=1e-6), step


def test_no_schedule_is_constant():
    fn = xshard.build_schedule({"optimizer": {"_target_": "optax.sgd", "learning_rate": 0.5}})
    assert float(fn(0)) == float(fn(1000)) == 0.5


# --------------------------------------------------------------------------------------------
# Wiring: global clip and the non-finite guard inside cross_shard, SUM with a mesh
# --------------------------------------------------------------------------------------------


def test_global_clip_after_reduction_and_guarded():
    tx = xshard.build_optimizer(make_cfg(clip=1.0))
    state = tx.init(PARAMS)
    grads = {"w": jnp.full((2, 2), 5.0), "b": jnp.zeros((2,))}  # norm 10
    updates, state = jax.jit(tx.update)(grads, state, PARAMS)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-5)  # sgd lr=1: -clipped

    bad = {"w": grads["w"].at[0, 0].set(jnp.nan), "b": grads["b"]}
    updates, state2 = jax.jit(tx.update)(bad, state, PARAMS)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(state2.skipped_steps) == 1


def test_skip_nonfinite_can_be_disabled():
    tx = xshard.build_optimizer(make_cfg(reduction={"mode": "mean", "skip_nonfinite": False}))
    grads = {"w": jnp.full((2, 2), jnp.nan), "b": jnp.zeros((2,))}
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    assert bool(jnp.isnan(updates["w"]).all())


def test_sum_outside_shard_map_scales_by_mesh_size(mesh):
    tx = xshard.build_optimizer(make_cfg(reduction={"mode": "sum"}), mesh=mesh)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(updates["w"], -8.0)


def test_mesh_axis_check(mesh):
    xshard.build_optimizer(make_cfg(reduction={"mode": "mean", "axis_name": ["data"]}), mesh=mesh)
    with pytest.raises(ConfigError) as e:
        xshard.build_optimizer(
            make_cfg(reduction={"mode": "mean", "axis_name": "batch"}), mesh=mesh
        )
    assert "reduction.axis_name" in str(e.value) and "'batch'" in str(e.value)
    assert "['data']" in str(e.value)


def test_weight_decay_mask_names_map_to_optax_arguments():
    # adamw takes `mask`, adafactor `weight_decay_mask`: both come from `weight_decay_mask`.
    for target, wd in (("optax.adamw", "weight_decay"), ("optax.adafactor", "weight_decay_rate")):
        tx = xshard.build_optimizer(
            make_cfg(
                optimizer={
                    "_target_": target,
                    "learning_rate": 1.0,
                    wd: 0.5,
                    "weight_decay_mask": "no_bias_no_norm",
                }
            )
        )
        zeros = jax.tree.map(jnp.zeros_like, PARAMS)
        updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
        assert bool(jnp.all(updates["b"] == 0)), target
        assert bool(jnp.all(updates["w"] != 0)), target


def test_no_bias_no_norm_mask():
    params = {
        "dense": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones((3,))},
        "layer_norm": {"scale": jnp.ones((3,)), "kernel_2d": jnp.ones((3, 3))},
        "embed": jnp.ones((5, 3)),
        "scalar": jnp.ones(()),
    }
    mask = xshard.optim.masks.no_bias_no_norm(params)
    assert mask == {
        "dense": {"kernel": True, "bias": False},
        "layer_norm": {"scale": False, "kernel_2d": False},
        "embed": True,
        "scalar": False,
    }


# --------------------------------------------------------------------------------------------
# Allowlist of targets
# --------------------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_opts.py").write_text(
        textwrap.dedent("""
        import optax

        def my_sgd(learning_rate, scale=1.0):
            return optax.chain(optax.scale(scale), optax.sgd(learning_rate))

        def only_w(params):
            return {k: k == "w" for k in params}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_opts"


def test_user_target_needs_allowed_targets(user_module):
    cfg = make_cfg(optimizer={"_target_": "my_opts.my_sgd", "learning_rate": 1.0, "scale": 2.0})
    with pytest.raises(ConfigError) as e:
        xshard.build_optimizer(cfg)
    msg = str(e.value)
    assert "optimizer._target_='my_opts.my_sgd' is not an allowed target" in msg
    assert "'optax.'" in msg and "allowed_targets" in msg and "+allowed_targets=[my_opts.]" in msg

    for allowed in (["my_opts."], ["my_opts"], ["my_opts.my_sgd"]):
        tx = xshard.build_optimizer({**cfg, "allowed_targets": allowed})
        updates, _ = tx.update(jax.tree.map(jnp.ones_like, PARAMS), tx.init(PARAMS), PARAMS)
        np.testing.assert_allclose(updates["w"], -2.0)


def test_user_mask_by_dotted_path(user_module):
    cfg = make_cfg(
        optimizer={
            "_target_": "optax.adamw",
            "learning_rate": 1.0,
            "weight_decay": 0.5,
            "weight_decay_mask": "my_opts.only_w",
        },
        allowed_targets=["my_opts."],
    )
    tx = xshard.build_optimizer(cfg)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, PARAMS), tx.init(PARAMS), PARAMS)
    assert bool(jnp.all(updates["b"] == 0)) and bool(jnp.all(updates["w"] != 0))
    cfg.pop("allowed_targets")
    with pytest.raises(
        ConfigError, match=r"optimizer\.weight_decay_mask='my_opts\.only_w' is not an allowed"
    ):
        xshard.build_optimizer(cfg)


def test_resolve_target_prefix_is_a_module_boundary():
    from xshard.config.targets import is_allowed

    assert is_allowed("optax.adamw", ("optax.",))
    assert not is_allowed("optaxevil.adamw", ("optax.",))
    assert not is_allowed("optaxevil.adamw", ("optax",))


# --------------------------------------------------------------------------------------------
# Bad config: each error names the key, the value and what is allowed
# --------------------------------------------------------------------------------------------

OPT = {"_target_": "optax.adam", "learning_rate": 1e-3}
COSINE = {"_target_": "xshard.schedules.cosine"}

# name: (config sections, fragments the message must contain)
# fmt: off
BAD_CONFIGS = {
    "unknown_mode": ({"reduction": {"mode": "avg"}}, ["reduction.mode", "'avg'", "'sum', 'mean'"]),
    "negative_lr": ({"optimizer": {**OPT, "learning_rate": -0.1}}, ["learning_rate=-0.1", "> 0"]),
    "zero_lr": ({"optimizer": {**OPT, "learning_rate": 0}}, ["optimizer.learning_rate=0", "> 0"]),
    "string_lr": ({"optimizer": {**OPT, "learning_rate": "x"}}, ["learning_rate='x'", "> 0"]),
    "unknown_optimizer": (
        {"optimizer": {**OPT, "_target_": "optax.adamz"}},
        ["optimizer._target_='optax.adamz'", "not found", "'optax.adam'"]),
    "disallowed_optimizer": (
        {"optimizer": {**OPT, "_target_": "os.system"}},
        ["optimizer._target_='os.system'", "not an allowed target", "'optax.'", "allowed_targets"]),
    "disallowed_schedule": (
        {"schedule": {"_target_": "builtins.eval"}},
        ["schedule._target_='builtins.eval'", "not an allowed target", "allowed_targets"]),
    "missing_optimizer": ({"optimizer": None}, ["optimizer is required"]),
    "missing_reduction": ({"reduction": None}, ["reduction is required"]),
    "missing_target": ({"optimizer": {"learning_rate": 1.0}}, ["optimizer._target_ is required"]),
    "missing_lr": ({"optimizer": {"_target_": "optax.sgd"}}, ["learning_rate is required"]),
    "mandatory_lr": (
        {"optimizer": {**OPT, "learning_rate": "???"}},
        ["optimizer.learning_rate is required but missing"]),
    "null_mode": ({"reduction": {"mode": None}}, ["reduction.mode=None", "expected a value"]),
    "unknown_reduction_key": (
        {"reduction": {"mode": "sum", "axis": "data"}},
        ["reduction.axis: unknown key", "axis_name", "skip_nonfinite"]),
    "bad_axis_name": ({"reduction": {"mode": "sum", "axis_name": 3}}, ["reduction.axis_name=3"]),
    "bad_comm_dtype": (
        {"reduction": {"mode": "sum", "comm_dtype": "int8"}},
        ["reduction.comm_dtype='int8'", "bfloat16"]),
    "bad_clip_per_shard": (
        {"reduction": {"mode": "sum", "clip_per_shard": 0}}, ["reduction.clip_per_shard=0", "> 0"]),
    "bad_skip_nonfinite": (
        {"reduction": {"mode": "sum", "skip_nonfinite": "maybe"}},
        ["reduction.skip_nonfinite='maybe'", "true or false"]),
    "bad_clip": ({"clip": -1.0}, ["clip=-1.0", "> 0"]),
    "unknown_optimizer_key": (
        {"optimizer": {**OPT, "b3": 0.9}},
        ["optimizer.b3: not an argument of optax.adam", "'b1'", "'learning_rate'"]),
    "unknown_mask": (
        {"optimizer": {**OPT, "_target_": "optax.adamw", "weight_decay_mask": "no_bias"}},
        ["optimizer.weight_decay_mask='no_bias'", "no_bias_no_norm", "null"]),
    "mask_on_maskless_optimizer": (
        {"optimizer": {**OPT, "weight_decay_mask": "no_bias_no_norm"}},
        ["optimizer.weight_decay_mask", "optax.adam takes no such mask"]),
    "schedule_missing_arg": (
        {"schedule": COSINE}, ["schedule.decay_steps is required by xshard.schedules.cosine"]),
    "schedule_unknown_arg": (
        {"schedule": {**COSINE, "decay_steps": 10, "warmup": 1}},
        ["schedule.warmup: not an argument of xshard.schedules.cosine", "'decay_steps'"]),
    "schedule_bad_steps": (
        {"schedule": {**COSINE, "decay_steps": 0}}, ["schedule.decay_steps=0", "1 <= decay_steps"]),
    "schedule_unresolved_interpolation": (
        {"schedule": {**COSINE, "decay_steps": "${trainer.steps}"}},
        ["schedule.decay_steps", "trainer.steps"]),
    "bad_allowed_targets": ({"allowed_targets": "mypkg."}, ["allowed_targets='mypkg.'", "list"]),
}
# fmt: on


@pytest.mark.parametrize("sections, expected", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_error_names_key_value_and_allowed(sections, expected):
    with pytest.raises(ConfigError) as e:
        xshard.build_optimizer(OmegaConf.create(make_cfg(**sections)))
    for fragment in expected:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert isinstance(e.value, ValueError)


def test_reduction_defaults_are_cross_shards():
    """A missing reduction key takes the schema default: mode mean over the data axes."""
    from xshard.config.schemas import ReductionConf

    state = xshard.build_optimizer({"optimizer": OPT, "reduction": {}}).init({"w": jnp.ones(2)})
    assert isinstance(xshard.inner_state(state), tuple)
    conf = xshard.optim.factory._reduction(
        OmegaConf.create({"reduction": {}, "mesh": {"axes": ["d"]}})
    )
    assert conf == ReductionConf(mode="mean", axis_name=("d",))


def test_the_reduction_node_is_parsed_once_into_the_optimizers_spec():
    """The schema parses ``reduction.mode``; the optimizer and the trainer read its spec."""
    from xshard.config.schemas import ReductionConf

    assert ReductionConf(mode=" SUM ").mode is xshard.Reduction.SUM
    tx = xshard.build_optimizer(make_cfg(reduction={"mode": " SUM ", "axis_name": ["data"]}))
    assert isinstance(tx, xshard.CrossShardTransformation)
    assert tx.spec.reduction is xshard.Reduction.SUM and tx.spec.axis_name == ("data",)
    assert tx.spec.skip_nonfinite  # the schema's default
