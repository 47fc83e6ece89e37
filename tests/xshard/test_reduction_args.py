"""The reduction's arguments have one rule for both ways in: `xshard.cross_shard`'s keywords
and the config's ``reduction.*`` keys refuse the same values, each naming its own key."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from omegaconf import OmegaConf

import xshard
from xshard.config.nodes import read_node
from xshard.config.schemas import ReductionConf
from xshard.errors import ConfigError

BAD = [
    ("axis_name", []),
    ("axis_name", ["data", "data"]),
    ("axis_name", [""]),
    ("clip_per_shard", 0),
    ("clip_per_shard", -1.5),
    ("clip_per_shard", "big"),
    ("comm_dtype", "int8"),
    ("comm_dtype", "float8"),
]


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_the_library_and_the_config_refuse_the_same_values(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        xshard.cross_shard(optax.sgd(0.1), **{key: value})
    with pytest.raises(ConfigError, match=rf"reduction\.{key}="):
        read_node(ReductionConf, OmegaConf.create({key: value}), "reduction")


@pytest.mark.parametrize(
    "value, name", [("bfloat16", "bfloat16"), (jnp.bfloat16, "bfloat16"), (jnp.float16, "float16")]
)
def test_a_comm_dtype_is_read_as_its_name(value, name):
    tx = xshard.cross_shard(optax.sgd(0.1), comm_dtype=value)
    assert jnp.dtype(tx.spec.comm_dtype) == jnp.dtype(name)


def test_good_values_are_parsed_once_in_the_schema():
    conf = read_node(
        ReductionConf,
        OmegaConf.create({"axis_name": ["slice", "data"], "clip_per_shard": 2, "comm_dtype": None}),
        "reduction",
    )
    assert conf.axis_name == ("slice", "data") and conf.clip_per_shard == 2.0
