"""Which config values are inputs of the compiled programs, and which are compile-time constants.

Every float argument of the ``optimizer``, ``schedule`` and
``reduction.axes.<axis>.outer_optimizer`` nodes, and ``clip``, enters the compiled programs as
an input, a float32 scalar (`xshard.optim.hyperparams.Hyperparams`): the jobs of a sweep that
differ only in such values lower to the same programs and share them through the persistent
compilation cache. What stays a compile-time constant: integers (counts and sizes: shapes,
loop lengths), booleans, strings, dtypes, masks, null (whether a value is set chooses the
program's structure: ``momentum: null`` builds no momentum), and a float whose rule is
`structural` (its factory branches on it in Python). The rule tables decide, by argument name:
`OPTIMIZER_RULES`, `SCHEDULE_RULES` and `CLIP_RULE`; an argument without a rule (a
``_target_`` of one's own) stays a constant. `hyperparameter_table` renders the decision for
docs/sweeps.md. JAX-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xshard.config.optimizers import OPTIMIZER_RULES
from xshard.config.ranges import FloatDtype, OneOf, Range, Rule
from xshard.config.schedule_schemas import SCHEDULE_RULES

#: The config key of the global-norm clip of the reduced gradient, and its rule.
CLIP_KEY = "clip"
CLIP_RULE = Range("a global norm for the reduced gradient", low_open=True, nullable=True)

#: The nodes whose arguments may be inputs, with the rules of their arguments (by name).
LIFTED_NODES: dict[str, Mapping[str, Rule]] = {
    "optimizer": OPTIMIZER_RULES,
    "schedule": SCHEDULE_RULES,
    "reduction.axes.<axis>.outer_optimizer": OPTIMIZER_RULES,
    CLIP_KEY: {"": CLIP_RULE},
}


def constant_because(rule: Rule | None) -> str:
    """Why an argument with `rule` is a compile-time constant; "" if it is an input (when its
    value is a number)."""
    if isinstance(rule, Range):
        if rule.integer:
            return "an integer: a count or size (shapes, loop lengths)"
        return rule.structural
    if isinstance(rule, FloatDtype):
        return "a dtype"
    if isinstance(rule, OneOf):
        return "a choice among names"
    return "no rule says it is a float"


def lifted(rule: Rule | None, value: Any) -> bool:
    """Whether a config value with `rule` is an input of the compiled programs: a number (not
    a bool, not null) whose rule is a float `Range` that is not `structural`."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return is_number and not constant_because(rule)


def lifted_values(
    rules: Mapping[str, Rule], node: Mapping[str, Any], prefix: str
) -> dict[str, Any]:
    """The values of `node`'s arguments that are inputs, by config key ``<prefix>.<name>``, as
    the config has them (Python numbers)."""
    return {f"{prefix}.{k}": v for k, v in node.items() if lifted(rules.get(k), v)}


def hyperparameter_table() -> str:
    """The markdown table of every argument the rule tables know: an input of the compiled
    programs, or a compile-time constant and why (docs/sweeps.md shows it;
    tests/xshard/test_hyperparams.py checks the two agree). Nodes that share a table share
    its rows."""
    lines = ["| node | argument | in the compiled programs |", "|---|---|---|"]
    tables: dict[int, list[str]] = {}
    for node, rules in LIFTED_NODES.items():
        tables.setdefault(id(rules), []).append(f"`{node}`")
    for rules in LIFTED_NODES.values():
        nodes = tables.pop(id(rules), [])
        for name, rule in sorted(rules.items()) if nodes else ():
            why = constant_because(rule)
            shown = f"constant: {why}" if why else "input"
            lines.append(f"| {', '.join(nodes)} | `{name or '-'}` | {shown} |")
    return "\n".join(lines)


def is_input_key(key: str, *values: Any) -> bool:
    """Whether config key `key` (``optimizer.learning_rate``, ``clip``,
    ``reduction.axes.slice.outer_optimizer.momentum``) is an input of the compiled programs
    with each of `values` (`lifted` by its node's rule in `LIFTED_NODES`): jobs that differ only
    in such keys run the same programs, and may train as one population."""
    parts = key.split(".")
    if len(parts) == 5 and parts[:2] == ["reduction", "axes"] and parts[3] == "outer_optimizer":
        node, name = "reduction.axes.<axis>.outer_optimizer", parts[4]
    elif len(parts) == 2:
        node, name = parts
    else:
        node, name = key, ""
    rules = LIFTED_NODES.get(node)
    return rules is not None and all(lifted(rules.get(name), v) for v in values)
