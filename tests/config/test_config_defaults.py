"""Every default is written once: schemas agree with the functions they feed, and the YAML
options state only what differs from their schema (or parent option)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os

import jax.numpy as jnp
import pytest
import yaml
from omegaconf import MISSING

from tests import REPO
from trainers.config import (
    CheckpointOptions,
    DistributedOptions,
    LoggerOptions,
    PrecisionOptions,
    ShardingOptions,
    TrainerOptions,
)
from trainers.config.loggers import TensorBoardLogger
from trainers.config.run import GRAD_IMPL_AUTO, GRAD_IMPLS
from trainers.core.trainer import Trainer
from xshard.config import read_node
from xshard.config.schemas import DEVIATIONS, SCHEMAS, MeshConf
from xshard.mesh.spec import mesh_spec
from xshard.optim.cross_shard import cross_shard
from xshard.optim.factory import MASK_ARGS

CONF = REPO / "conf"


def _target(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _defaults(schema: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(schema):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


TARGETED = [(g, n, s) for g in ("optimizer", "schedule") for n, s in SCHEMAS[g].items()]


@pytest.mark.parametrize("group, name, schema", TARGETED, ids=[f"{g}/{n}" for g, n, _ in TARGETED])
def test_schema_defaults_equal_the_target_defaults(group, name, schema):
    defaults = _defaults(schema)
    params = inspect.signature(_target(defaults["_target_"])).parameters
    for key, value in defaults.items():
        if key == "_target_" or value is MISSING:
            continue
        names = MASK_ARGS.get(key, (key,))  # weight_decay_mask may go to optax's `mask`
        assert any(n in params for n in names), f"{group}/{name}.{key}: not an argument"
        if key in DEVIATIONS:
            continue
        assert value == params[key].default, f"{group}/{name}.{key}: {value!r} in the schema"
    required = [k for k, p in params.items() if p.default is inspect.Parameter.empty]
    for key in required[1:]:  # the first is the learning rate, which xshard passes
        assert defaults.get(key, MISSING) is MISSING, f"{group}/{name}.{key} must be required"


def test_reduction_schema_is_cross_shards_keyword_arguments():
    params = inspect.signature(cross_shard).parameters
    for key, value in _defaults(SCHEMAS["reduction"]["base"]).items():
        arg = "reduction" if key == "mode" else key
        if key == "axes":  # built into AxisRules by xshard.optim.factory.build_optimizer_with_rules
            assert _defaults(SCHEMAS["reduction"]["base"])["axes"] == {}
            continue
        assert arg in params, f"reduction.{key} is not an argument of cross_shard"
        if key not in DEVIATIONS:
            assert value == params[arg].default, f"reduction.{key}: {value!r}"


def test_mesh_schema_defaults_are_mesh_specs():
    assert mesh_spec(_defaults(MeshConf)) == mesh_spec({})


def test_trainer_schema_defaults_equal_the_trainer_api_defaults():
    primary = yaml.safe_load((CONF / "xshard_train.yaml").read_text())
    params = inspect.signature(Trainer).parameters
    defaults = TrainerOptions()
    assert defaults.microbatches == params["microbatches"].default
    # The CLI races the paths (`trainers.app.grad_path`); `Trainer` takes one of them.
    assert defaults.grad_impl == GRAD_IMPL_AUTO
    assert params["grad_impl"].default in GRAD_IMPLS
    assert primary["seed"] == params["seed"].default
    assert ShardingOptions().zero_stage == params["zero_stage"].default
    assert "trainer" not in primary and "distributed" not in primary  # only in the schemas


@pytest.mark.parametrize(
    "schema",
    [
        TrainerOptions,
        DistributedOptions,
        CheckpointOptions,
        LoggerOptions,
        ShardingOptions,
        PrecisionOptions,
    ],
)
def test_run_node_schemas_compose_with_their_defaults(schema, compose_config):
    """The composed node equals the dataclass defaults; the YAML options add nothing."""
    key = {TrainerOptions: "trainer", DistributedOptions: "distributed"}.get(
        schema, schema.__name__.removesuffix("Options").lower()
    )
    composed = read_node(schema, compose_config()[key], key)
    overridden: dict = {
        "trainer": {"batch_size": 16, "progress": False},
        "logger": {"tensorboard": TensorBoardLogger()},  # logger=tensorboard, the default
    }.get(key, {})
    if key == "trainer":  # the default cache dir, resolved (conftest sets XDG_CACHE_HOME)
        cache = os.path.join(os.environ["XDG_CACHE_HOME"], "xshard", "jax")
        overridden["compilation_cache_dir"] = cache
    assert composed == dataclasses.replace(schema(), **overridden)


OPTIONS = sorted(
    p for g in ("optimizer", "schedule", "reduction", "mesh") for p in (CONF / g).glob("*.yaml")
)


@pytest.mark.parametrize("path", OPTIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_yaml_options_state_only_deviations(path):
    raw = yaml.safe_load(path.read_text())
    defaults = raw.pop("defaults")
    base = defaults[0]
    if isinstance(base, dict):  # /xshard_schemas/<group>@_here_: <schema>
        (schema_name,) = base.values()
        inherited = _defaults(SCHEMAS[path.parent.name][schema_name])
    else:  # a parent option of the same group
        parent = yaml.safe_load((path.parent / f"{base}.yaml").read_text())
        parent.pop("defaults")
        (schema_name,) = yaml.safe_load((path.parent / f"{base}.yaml").read_text())["defaults"][
            0
        ].values()
        inherited = {**_defaults(SCHEMAS[path.parent.name][schema_name]), **parent}
    restated = sorted(k for k, v in raw.items() if k in inherited and inherited[k] == v)
    assert not restated, f"{path.name} restates inherited defaults: {restated}"


def test_a_new_optimizer_option_is_one_yaml_file(tmp_path):
    """The docs' "Adding an optimizer" example, composed from a user's own config dir."""
    from hydra import compose, initialize_config_module

    import xshard

    (tmp_path / "optimizer").mkdir()
    (tmp_path / "optimizer" / "nadamw.yaml").write_text(
        "defaults:\n  - /xshard_schemas/optimizer@_here_: adamw\n  - _self_\n\n"
        "_target_: optax.nadamw\nlearning_rate: 1e-3\n"
    )
    with initialize_config_module("xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train",
            overrides=["optimizer=nadamw", f"hydra.searchpath=[file://{tmp_path}]"],
        )
    assert cfg.optimizer._target_ == "optax.nadamw" and cfg.optimizer.weight_decay == 1e-4
    assert xshard.build_optimizer(cfg).init({"w": jnp.ones((2, 2))}) is not None
