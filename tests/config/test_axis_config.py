"""``reduction.axes.<axis>``: each bad value is one ConfigError naming the key, the value and
what is allowed, from the schema (no mesh) or against the mesh (xshard.optim.axis_factory)."""

import re

import pytest

from xshard.config import read_node
from xshard.config.schemas import ReductionConf
from xshard.errors import ConfigError
from xshard.optim.axis_factory import axis_rules

AVG = {"_target_": "optax.sgd", "learning_rate": 1.0}


@pytest.mark.parametrize(
    "axes, fragments",
    [
        ({"slice": {"every_steps": 0, "outer_optimizer": AVG}}, ["axes.slice.every_steps=0"]),
        ({"slice": {"every_steps": 8}}, ["axes.slice.every_steps=8", "outer_optimizer"]),
        (
            {"slice": {"every_steps": 2, "fragments": 3, "outer_optimizer": AVG}},
            ["axes.slice.fragments=3", "every_steps=2"],
        ),
        ({"slice": {"fragments": 0, "outer_optimizer": AVG}}, ["axes.slice.fragments=0"]),
        ({"data": {"comm_dtype": "int3"}}, ["axes.data.comm_dtype='int3'", "int8"]),
        ({"data": {"rule": "median"}}, ["axes.data.rule='median'", "adasum"]),
        ({"data": {"error_feedback": True}}, ["axes.data.error_feedback", "comm_dtype"]),
        (
            {"slice": {"rule": "adasum", "outer_optimizer": AVG}},
            ["axes.slice.rule='adasum'", "periodic"],
        ),
        ({"slice": {"outer_optimizer": "sgd"}}, ["axes.slice.outer_optimizer='sgd'", "_target_"]),
        ({"data": {"warmup_steps": 3}}, ["axes.data.warmup_steps=3", "periodic"]),
        (
            {"slice": {"outer_optimizer": AVG}, "data": {"outer_optimizer": AVG}},
            ["reduction.axes", "one periodic axis"],
        ),
    ],
)
def test_schema_refuses_bad_axis_values_naming_the_key(axes, fragments):
    with pytest.raises(ConfigError) as e:
        read_node(ReductionConf, {"axes": axes}, "reduction")
    message = str(e.value)
    assert "\n" not in message
    for fragment in ["reduction.", *fragments]:
        assert fragment in message, (fragment, message)


SHAPE = {"slice": 2, "data": 4}
DATA = ("slice", "data")
ALLOWED = ("optax.",)


@pytest.mark.parametrize(
    "axes, shape, data_axes, fragments",
    [
        ({"slice": {"outer_optimizer": AVG}}, {"data": 8}, ("data",), ["slice", "['data']"]),
        ({"data": {"rule": "adasum"}}, {"slice": 2, "data": 3}, DATA, ["rule=adasum", "size 3"]),
        ({"slice": {"outer_optimizer": AVG}}, SHAPE, ("data",), ["data axis", "['data']"]),
        (
            {"slice": {"outer_optimizer": {"_target_": "os.system"}}},
            SHAPE,
            DATA,
            ["reduction.axes.slice.outer_optimizer._target_"],
        ),
        (
            {"slice": {"outer_optimizer": {**AVG, "momentum": 2.0}}},
            SHAPE,
            DATA,
            ["reduction.axes.slice.outer_optimizer.momentum=2"],
        ),
        (
            {"slice": {"outer_optimizer": {**AVG, "lr": 1.0}}},
            SHAPE,
            DATA,
            ["reduction.axes.slice.outer_optimizer.lr"],
        ),
    ],
)
def test_mesh_checks_name_the_axis_key(axes, shape, data_axes, fragments):
    conf = read_node(ReductionConf, {"axes": axes}, "reduction")
    with pytest.raises(ConfigError) as e:
        axis_rules(conf.axes, shape, data_axes, ALLOWED)
    message = str(e.value)
    assert "\n" not in message and "reduction.axes." in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_good_presets_become_axis_rules():
    conf = read_node(
        ReductionConf,
        {
            "axes": {
                "slice": {
                    "every_steps": 8,
                    "outer_optimizer": AVG,
                    "comm_dtype": "int8",
                    "error_feedback": True,
                },
                "data": {"rule": "adasum"},
            }
        },
        "reduction",
    )
    rules = axis_rules(conf.axes, SHAPE, DATA, ALLOWED)
    assert rules["slice"].periodic and rules["slice"].comm_dtype == "int8"
    assert not rules["data"].periodic and rules["data"].rule == "adasum"


@pytest.mark.parametrize(
    "axes",
    [
        {"data": {"comm_dtype": "int3"}},
        {"data": {"rule": "median"}},
        {"data": {"error_feedback": True}},
        {"data": {"rule": "adasum", "comm_dtype": "int8"}},
        {"slice": {"every_steps": 8}},
        {"slice": {"rule": "adasum", "outer_optimizer": AVG}},
        {"slice": {"comm_dtype": "int8", "error_feedback": True}, "data": {"rule": "sum"}},
    ],
)
def test_library_and_config_refuse_a_rule_in_the_same_words(axes):
    """`cross_shard(axes=...)` names ``axes.<axis>.<key>`` where the config names
    ``reduction.axes.<axis>.<key>``; the rest of the message is the same (written once)."""
    import optax

    import xshard
    from xshard.config.axes import AxisRule

    with pytest.raises(ConfigError) as from_config:
        read_node(ReductionConf, {"axes": axes}, "reduction")
    outer = optax.sgd(1.0)
    rules = {
        axis: AxisRule(**(node | ({"outer_optimizer": outer} if "outer_optimizer" in node else {})))
        for axis, node in axes.items()
    }
    with pytest.raises(ValueError) as from_library:
        xshard.cross_shard(optax.sgd(1.0), axis_name=("slice", "data"), axes=rules)
    named_as_config = re.sub(r"(?<![\w.])axes\b", "reduction.axes", str(from_library.value))
    assert str(from_config.value) == named_as_config
