"""xshard's config groups: every option composes, builds and runs on 8 shards.

The options are enumerated from Hydra (the groups as the SearchPathPlugin exposes them), not
hard-coded. Options are composed under a small primary config with the same defaults list as
``xshard_train`` for the optimizer groups, so these tests need none of the other groups.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from omegaconf import OmegaConf

import xshard
import xshard.conf
from xshard import ConfigError

CONF_DIR = Path(xshard.conf.__file__).parent
GROUPS = ("optimizer", "schedule", "reduction", "experiment")
NUM_SHARDS = 8

PRIMARY = """\
defaults:
  - _self_
  - optimizer: adamw
  - schedule: warmup_cosine
  - reduction: mean
  - experiment: null
clip: null
trainer:
  steps: 100
"""


def group_options(group: str) -> list[str]:
    with initialize_config_module("xshard.conf", version_base="1.3"):
        return GlobalHydra.instance().config_loader().get_group_options(group)


OPTIONS = [(group, option) for group in GROUPS for option in group_options(group)]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conf")
    (path / "primary.yaml").write_text(PRIMARY)
    return path


@pytest.fixture
def compose_cfg(config_dir):
    def _compose(*overrides: str):
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            return compose("primary", overrides=list(overrides))

    return _compose


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= NUM_SHARDS
    return jax.make_mesh((NUM_SHARDS,), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def slices_mesh():
    """mesh=cpu2x4_slices's mesh: the per-axis presets name its DCN axis `slice`."""
    return jax.make_mesh((2, 4), ("slice", "data"), axis_types=(AxisType.Auto,) * 2)


# A weight matrix, a bias and a norm scale, so that weight-decay masks are exercised.
PARAMS = {
    "dense": {"kernel": jnp.full((4, 3), 0.5), "bias": jnp.full((3,), 0.5)},
    "norm": {"scale": jnp.ones((3,))},
}


def per_shard_loss(params, shard):
    return sum(jnp.sum(jnp.tanh(p * (shard + 1.0))) for p in jax.tree.leaves(params))


def run(tx, mesh, steps: int = 2):
    """Runs `steps` updates inside shard_map with per-shard gradients.

    Returns (updates of the last step, the final state, updates of a zero gradient from the
    initial state, the learning rate read from the state after each step).
    """

    from xshard.reduce.per_axis import state_partition_specs

    axes = tx.spec.axis_name  # a gradient per shard of the axes it reduces over

    def body(params, state):
        local = jax.lax.pcast(params, axes, to="varying")
        shard = jax.lax.axis_index(axes).astype(jnp.float32)
        grads = jax.grad(per_shard_loss)(local, shard)
        return tx.update(grads, state, params)

    def zero_grad(params, state):
        zeros = jax.tree.map(jnp.zeros_like, jax.lax.pcast(params, axes, to="varying"))
        return tx.update(zeros, state, params)[0]

    with jax.set_mesh(mesh):  # an axis rule sizes its state from the mesh
        state = tx.init(PARAMS)
    state_specs = state_partition_specs(state)  # P() but per-replica residuals
    specs = dict(mesh=mesh, in_specs=(P(), state_specs))
    step = jax.jit(jax.shard_map(body, out_specs=(P(), state_specs), **specs))
    zero_updates = jax.jit(jax.shard_map(zero_grad, out_specs=P(), **specs))(PARAMS, state)
    rates = []
    for _ in range(steps):
        updates, state = step(PARAMS, state)
        rates.append(float(optax.tree_utils.tree_get(state, "learning_rate")))  # blocks
    return updates, state, zero_updates, rates


def test_groups_list_exactly_the_yaml_files():
    # The schemas are in the ConfigStore group xshard_schemas/, never options of these groups.
    for group in GROUPS:
        on_disk = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert on_disk, group
        assert group_options(group) == on_disk
    assert "adamw" in group_options("xshard_schemas/optimizer")


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_builds_and_runs(compose_cfg, mesh, slices_mesh, group, option):
    overrides = [f"{group}={option}"]
    if group == "optimizer":
        overrides.append("schedule=constant")  # the rate is non-zero from the first step
    if option == "diloco_elastic":  # each group names its id (no default: two would clash)
        overrides.append("reduction.axes.slice.elastic.group=0")
    cfg = compose_cfg(*overrides)
    if "slice" in cfg.reduction.axes:  # a per-axis preset of the DCN axis: on its mesh
        cfg, mesh = compose_cfg(*overrides, "+mesh=cpu2x4_slices"), slices_mesh
        if cfg.reduction.axes.slice.outer_optimizer is not None:
            check_periodic_sync(cfg, mesh)
    tx = xshard.build_optimizer(cfg, mesh=mesh)
    updates, state, zero_updates, rates = run(tx, mesh)

    assert jax.tree.structure(updates) == jax.tree.structure(PARAMS)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
    assert any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    assert int(state.skipped_steps) == 0
    assert rates[-1] > 0

    if group != "optimizer":
        return
    # Zero gradient from the initial state: only weight decay moves a parameter, and the
    # no_bias_no_norm mask keeps it off the bias and the norm scale.
    decays = cfg.optimizer.get("weight_decay_mask") is not None and (
        cfg.optimizer.get("weight_decay") or cfg.optimizer.get("weight_decay_rate")
    )
    assert bool(jnp.all(zero_updates["dense"]["bias"] == 0))
    assert bool(jnp.all(zero_updates["norm"]["scale"] == 0))
    kernel_moves = bool(jnp.all(zero_updates["dense"]["kernel"] != 0))
    assert kernel_moves == bool(decays), cfg.optimizer


def check_periodic_sync(cfg, mesh):
    """The preset's periodic rule syncs as it is meant to: replicas over `slice` that drifted
    apart give new outer params, the same on every replica, moved towards their mean."""
    from xshard.optim.factory import build_optimizer_with_rules
    from xshard.reduce.periodic import init_outer, sync_fragment

    periodic = build_optimizer_with_rules(cfg, mesh=mesh).periodic
    assert periodic is not None
    axis, rule = periodic
    assert axis == "slice" and rule.every_steps > 1
    leaves = jax.tree.leaves(PARAMS)
    outer = init_outer(rule, leaves, (tuple(range(len(leaves))),), 2)

    def one(params, opt_state, residual):
        shift = jax.lax.axis_index("slice").astype(jnp.float32) + 1.0  # replicas 1 and 2
        replica = [jax.lax.pcast(p, "slice", to="varying") + shift for p in params]
        res = None if residual is None else residual[0]
        done = sync_fragment(rule, "slice", params, opt_state, res, replica)
        return done.params, done.stats

    residual = outer.residual[0]
    sync = jax.shard_map(
        one,
        mesh=mesh,
        in_specs=(P(), P(), None if residual is None else P("slice")),
        out_specs=(P(), P()),
        axis_names={"slice"},
    )
    new, stats = jax.jit(sync)(outer.params[0], outer.opt_state[0], residual)
    assert float(stats.skipped) == 0 and float(stats.replica_drift) > 0
    for old, p in zip(leaves, new, strict=True):
        moved = np.asarray(p) - np.asarray(old)
        assert np.all(moved > 0), moved  # towards the replicas' mean, old + 1.5


def test_experiments_set_what_they_say(compose_cfg):
    cfg = compose_cfg("experiment=gpt_adamw_sum")
    assert cfg.reduction.mode == "sum" and cfg.clip == 8.0
    assert cfg.optimizer._target_ == "optax.adamw" and cfg.optimizer.learning_rate == 3e-4
    assert cfg.schedule.decay_steps == cfg.trainer.steps == 500
    cfg = compose_cfg("experiment=lamb_mean_clipped")
    assert cfg.reduction.clip_per_shard == 1.0 and cfg.optimizer._target_ == "optax.lamb"


@pytest.mark.parametrize("experiment", [None, *group_options("experiment")])
def test_primary_config_builds_with_every_experiment(mesh, experiment):
    overrides = [] if experiment is None else [f"experiment={experiment}"]
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose("xshard_train", overrides=overrides)
    tx = xshard.build_optimizer(cfg, mesh=mesh)
    assert isinstance(tx.init(PARAMS), xshard.CrossShardState)


def test_sum_is_num_shards_times_mean(compose_cfg, mesh):
    reduced = {}
    for mode in ("sum", "mean"):
        cfg = compose_cfg(
            "optimizer=sgd", "optimizer.learning_rate=1.0", "~schedule", f"reduction={mode}"
        )
        assert "schedule" not in cfg
        updates, *_ = run(xshard.build_optimizer(cfg, mesh=mesh), mesh, steps=1)
        reduced[mode] = jax.tree.map(lambda u: -u, updates)  # sgd, lr=1: update = -grad

    # d/dp tanh(p (s+1)) summed over shards s = 0..7, and its mean.
    def grad_of_shard(p, s):
        return (s + 1.0) / jnp.cosh(p * (s + 1.0)) ** 2

    expected_sum = jax.tree.map(lambda p: sum(grad_of_shard(p, s) for s in range(8)), PARAMS)
    leaves = [jax.tree.leaves(t) for t in (reduced["sum"], reduced["mean"], expected_sum)]
    for got_sum, got_mean, want_sum in zip(*leaves, strict=True):
        np.testing.assert_allclose(got_sum, NUM_SHARDS * got_mean, rtol=1e-6)
        np.testing.assert_allclose(got_sum, want_sum, rtol=1e-5)


def test_learning_rate_in_state_follows_warmup_cosine(compose_cfg, mesh):
    cfg = compose_cfg(
        "optimizer=sgd",
        "schedule=warmup_cosine",
        "schedule.warmup_steps=4",
        "trainer.steps=12",
    )
    assert cfg.schedule.decay_steps == 12  # ${trainer.steps}
    tx = xshard.build_optimizer(cfg, mesh=mesh)
    *_, rates = run(tx, mesh, steps=12)
    peak = cfg.optimizer.learning_rate
    # The state holds the rate of the last update: after update k, schedule(k - 1).
    schedule = xshard.build_schedule(cfg)
    np.testing.assert_allclose(rates, [float(schedule(k)) for k in range(12)], rtol=1e-6)
    np.testing.assert_allclose(rates[:5], [0, peak / 4, peak / 2, 3 * peak / 4, peak], rtol=1e-6)
    np.testing.assert_allclose(rates[8], peak / 2, rtol=1e-6)  # half way through the cosine
    assert rates[4] > rates[8] > rates[11] > 0


# --------------------------------------------------------------------------------------------
# Overrides and struct mode
# --------------------------------------------------------------------------------------------


def test_overrides_reach_the_optimizer(compose_cfg, mesh):
    cfg = compose_cfg("optimizer.learning_rate=3e-4", "reduction=sum", "schedule=constant")
    assert cfg.optimizer.learning_rate == 3e-4 and cfg.reduction.mode == "sum"
    state = xshard.build_optimizer(cfg, mesh=mesh).init(PARAMS)
    assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(3e-4)


def test_reduction_axis_name_list_override(compose_cfg, mesh):
    cfg = compose_cfg("reduction.axis_name=[data]")
    assert OmegaConf.to_container(cfg.reduction.axis_name) == ["data"]
    run(xshard.build_optimizer(cfg, mesh=mesh), mesh, steps=1)
    with pytest.raises(ConfigError, match=r"reduction\.axis_name.*'model'.*\['data'\]"):
        xshard.build_optimizer(compose_cfg("reduction.axis_name=[data,model]"), mesh=mesh)


def _messages(exc: BaseException) -> str:
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__
    return "\n".join(parts)


def test_unknown_key_rejected_by_struct_mode(compose_cfg):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg("optimizer.some_key=1")
    assert "Could not override 'optimizer.some_key'" in _messages(e.value)
    assert "Key 'some_key' not in 'AdamWConf'" in _messages(e.value)
    with pytest.raises(ConfigCompositionException, match="Could not override 'reduction.axis'"):
        compose_cfg("reduction.axis=data")


def test_appended_key_rejected_by_the_factory(compose_cfg):
    cfg = compose_cfg("+optimizer.some_key=1")  # '+' asks Hydra to add it: the schema allows
    with pytest.raises(ConfigError, match=r"optimizer\.some_key: not an argument of optax\.adamw"):
        xshard.build_optimizer(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("reduction.skip_nonfinite=maybe", "Value 'maybe' is not a valid bool"),
        ("optimizer.learning_rate=fast", "Value 'fast' of type 'str' could not be converted"),
        ("optimizer.nesterov=sometimes", "is not a valid bool"),
    ],
)
def test_schema_type_errors_at_composition(compose_cfg, override, message):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(override)
    assert message in _messages(e.value)


@pytest.mark.parametrize(
    "value, shown", [("1.5", "1.5"), ("3e9", "3000000000.0"), ("abc", "'abc'")]
)
def test_schedule_values_are_checked_when_the_schedule_is_built(compose_cfg, value, shown):
    """The schedule group is composed permissively (`CHECKED_WHEN_READ`): its rules refuse a
    value of the wrong type in one line naming the key, as the trainer's nodes do."""
    cfg = compose_cfg(f"schedule.warmup_steps={value}")
    with pytest.raises(ConfigError, match=rf"^schedule\.warmup_steps={shown}: expected steps"):
        xshard.build_optimizer(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("reduction.mode=avg", "Unsupported reduction.mode: 'avg'. Allowed: 'sum', 'mean'"),
        ("optimizer.learning_rate=-1", "optimizer.learning_rate=-1.0: expected"),
        ("optimizer._target_=optax.adamz", "optimizer._target_='optax.adamz' was not found"),
        ("optimizer.weight_decay_mask=no_bias", "optimizer.weight_decay_mask='no_bias'"),
        ("optimizer._target_=os.system", "not an allowed target"),
    ],
)
def test_value_errors_at_build(compose_cfg, override, message):
    cfg = compose_cfg(override)
    with pytest.raises(ConfigError) as e:
        xshard.build_optimizer(cfg)
    assert message in str(e.value)


# --------------------------------------------------------------------------------------------
# Plugin discovery
# --------------------------------------------------------------------------------------------


def test_plugin_discovery_registers_schemas_without_importing_jax():
    code = (
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.search_path_plugin import SearchPathPlugin\n"
        "from hydra.core.config_store import ConfigStore\n"
        "names = [p.__name__ for p in Plugins.instance().discover(SearchPathPlugin)]\n"
        "assert 'XShardSearchPathPlugin' in names, names\n"
        "groups = ConfigStore.instance().list('xshard_schemas')\n"
        "assert groups == sorted(['checkpoint', 'data', 'distributed', 'logger', 'logger_node', "
        "'mesh', 'optimizer', 'paths', 'precision', 'reduction', 'schedule', 'sharding', "
        "'trainer']), groups\n"
        "heavy = sorted(m for m in ('jax', 'jaxlib', 'optax') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=120)


# --------------------------------------------------------------------------------------------
# The real CLI (python -m trainers.train)
# --------------------------------------------------------------------------------------------


def test_cli_overrides_in_printed_job_config(tmp_path):
    from tests.cli import run_train

    proc = run_train(
        "--cfg=job", "optimizer=sgd", "optimizer.learning_rate=3e-4", "reduction=sum", cwd=tmp_path
    )
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.optimizer._target_ == "optax.sgd" and cfg.optimizer.learning_rate == 3e-4
    assert cfg.reduction.mode == "sum" and cfg.reduction.skip_nonfinite is True
    assert cfg.schedule._target_ == "xshard.schedules.warmup_cosine"
    assert OmegaConf.to_container(cfg.schedule)["decay_steps"] == "${trainer.steps}"


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.some_key=1", "optimizer.some_key=1: unknown key. Allowed keys: ['_target_',"),
        ("reduction.skip_nonfinite=maybe", "Value 'maybe' is not a valid bool"),
    ],
)
def test_cli_rejects_bad_override_in_one_line_even_printing_the_config(tmp_path, override, message):
    from tests.cli import refused, run_train

    refused(run_train("--cfg=job", override, cwd=tmp_path, check=False), message)


def test_cli_reports_config_error_from_the_factory(tmp_path):
    from tests.cli import run_train

    proc = run_train("trainer.steps=1", "optimizer.learning_rate=-1", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert (
        "optimizer.learning_rate=-1.0: expected the base (peak) learning rate, a finite number > 0"
        in proc.stderr
    )
