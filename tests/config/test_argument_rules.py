"""Every rule of `OPTIMIZER_RULES` and `SCHEDULE_RULES` on every schema that has the argument,
in one process: the schemas check themselves, `build_optimizer` / `build_schedule` apply the
same rules to a node whatever its ``_target_``, and `xshard.schedules` to its own arguments.
The bounds come from `xshard.config.ranges` (finite numbers, float dtypes, at most `MAX_STEPS`
for every integer). The same values through the trainer and its CLI are in
tests/trainers/app/test_bad_values.py.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from omegaconf import OmegaConf

import xshard
import xshard.schedules
from xshard.config.optimizers import OPTIMIZER_RULES, check_optimizer_args
from xshard.config.ranges import FLOAT_DTYPES, MAX_STEPS, FloatDtype, OneOf, Rule
from xshard.config.schedule_schemas import SCHEDULE_RULES
from xshard.config.schemas import SCHEMAS
from xshard.errors import ConfigError

GROUP_RULES = {"optimizer": OPTIMIZER_RULES, "schedule": SCHEDULE_RULES}
#: The arguments a group's schemas need to be built at all (the others keep their defaults).
REQUIRED = {
    "optimizer": {"learning_rate": 1e-3},
    "schedule": {"decay_steps": 100, "warmup_steps": 10, "transition_steps": 10, "decay_rate": 0.5},
}
RULED = [
    (group, schema, arg)
    for group, rules in GROUP_RULES.items()
    for schema in SCHEMAS[group].values()
    for arg in (f.name for f in dataclasses.fields(schema))
    if arg in rules
]


def _build(group: str, schema: type, **args: object) -> object:
    names = {f.name for f in dataclasses.fields(schema)}
    return schema(**{**{k: v for k, v in REQUIRED[group].items() if k in names}, **args})


def _bad_values(rule: Rule) -> list[object]:
    if isinstance(rule, OneOf):
        return ["foo", rule.values[0].upper(), 1, True, None]
    if isinstance(rule, FloatDtype):
        return ["int8", "int32", "bool", "foo", 1, True, *([] if rule.nullable else [None])]
    bad: list[object] = [rule.low - 1, math.nan, math.inf, -math.inf, "x", True]
    if rule.low_open:
        bad.append(rule.low)
    if rule.high is not None:
        bad += [rule.high + 1, *([] if rule.high_closed else [rule.high])]
    if rule.integer:
        bad += [rule.low + 0.5, MAX_STEPS + 1]
    if not rule.nullable:
        bad.append(None)
    return bad


def _good_values(rule: Rule) -> list[object]:
    if isinstance(rule, OneOf):
        return list(rule.values)
    if isinstance(rule, FloatDtype):
        return [*FLOAT_DTYPES, *([None] if rule.nullable else [])]
    good: list[object] = [] if rule.low_open else [int(rule.low) if rule.integer else rule.low]
    if rule.high is not None:
        good.append(rule.high if rule.high_closed else rule.high - 0.01)
    if rule.integer:
        good.append(MAX_STEPS)
    return good + ([None] if rule.nullable else [])


def test_every_schema_has_a_rule_for_its_numbers_and_dtypes():
    """A new numeric or dtype argument in a schema needs its rule."""
    for group, rules in GROUP_RULES.items():
        for name, schema in SCHEMAS[group].items():
            for f in dataclasses.fields(schema):
                if f.type in ("float", "float | None", "int") or "dtype" in f.name:
                    assert f.name in rules, f"{group}/{name}.{f.name} has no rule"


@pytest.mark.parametrize(
    "group, schema, arg", RULED, ids=[f"{s.__name__}.{a}" for _, s, a in RULED]
)
def test_schema_refuses_out_of_range_arguments(group, schema, arg):
    rule = GROUP_RULES[group][arg]
    _build(group, schema)  # the defaults obey the rules
    for value in _good_values(rule):
        _build(group, schema, **{arg: value})
    for value in _bad_values(rule):
        with pytest.raises(ConfigError) as err:
            _build(group, schema, **{arg: value})
        message = str(err.value)
        assert message.startswith(f"{group}.{arg}={value!r}: expected {rule.what}, "), message


def test_a_schedule_factory_refuses_what_its_schema_refuses():
    """The library's own factories read the same rules, naming the bare argument."""
    with pytest.raises(ConfigError, match=r"^end_factor=nan: expected the final rate"):
        xshard.schedules.cosine(1.0, decay_steps=10, end_factor=math.nan)
    with pytest.raises(ConfigError, match=r"^init_factor=-5: expected the first rate"):
        xshard.schedules.warmup_linear(1.0, warmup_steps=2, decay_steps=10, init_factor=-5)
    with pytest.raises(ConfigError, match=r"^decay_rate=0: expected the factor"):
        xshard.schedules.exponential(1.0, transition_steps=10, decay_rate=0)
    assert float(xshard.schedules.warmup_cosine(1.0, warmup_steps=2, decay_steps=4)(2)) == 1.0


@pytest.mark.parametrize(
    "node, message",
    [
        (
            {"_target_": "optax.cosine_decay_schedule", "decay_steps": 10, "exponent": 0},
            "schedule.exponent=0: expected the exponent",
        ),
        (
            {"_target_": "optax.exponential_decay", "transition_steps": 2**31, "decay_rate": 0.5},
            "schedule.transition_steps=2147483648: expected",
        ),
    ],
)
def test_build_schedule_applies_the_rules_to_any_target(node, message):
    cfg = {"optimizer": {"learning_rate": 1e-3}, "schedule": node}
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        xshard.build_schedule(OmegaConf.create(cfg))


@pytest.mark.parametrize(
    "node, message",
    [
        ({"_target_": "optax.adamax", "b1": 1.5}, "optimizer.b1=1.5: expected"),
        ({"_target_": "optax.adabelief", "eps": -1e-8}, "optimizer.eps=-1e-08: expected"),
        ({"_target_": "optax.adamw", "weight_decay": -0.1}, "optimizer.weight_decay=-0.1: exp"),
        ({"_target_": "optax.sgd", "momentum": -0.5}, "optimizer.momentum=-0.5: expected"),
    ],
)
def test_build_optimizer_applies_the_rules_to_any_target(node, message):
    """Also optimizers without a schema of their own: a rule is the argument's, by name."""
    cfg = {"optimizer": {"learning_rate": 1e-3, **node}, "reduction": {"mode": "mean"}}
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        xshard.build_optimizer(OmegaConf.create(cfg))
    check_optimizer_args({"b1": 0.0, "eps": 0.0, "momentum": None})  # boundaries are allowed
