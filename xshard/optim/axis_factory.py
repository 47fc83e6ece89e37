"""``reduction.axes`` -> `xshard.AxisRule`s: the checks that need the mesh, and the outer optimizer.

`xshard.config.axes` checks each ``reduction.axes.<axis>`` node on its own; what depends on
the mesh is checked here, once, when the optimizer is built (`xshard.optim.factory`): the axis must
be an axis of the mesh, a periodic axis a data axis, an Adasum axis of power-of-two size.
Each ``outer_optimizer`` node is built like the ``optimizer`` node: its ``_target_`` must pass
the ``allowed_targets`` allowlist, its keys must be the factory's arguments, and the arguments
every optax optimizer shares (``learning_rate``, ``momentum``, ``b1``, ...) obey the schemas'
`OPTIMIZER_RULES`, as the inner optimizer's do. An argument may be a node with its own
``_target_`` (``learning_rate: {_target_: optax.cosine_decay_schedule, init_value: 0.7,
decay_steps: 100}``), built under the same allowlist (every target checked by name before
anything is imported); a ``learning_rate`` node must build a schedule, which optax evaluates
at the outer optimizer's own count: it counts outer steps (syncs of the fragment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import optax

from xshard.config.axes import AxisReductionConf, AxisRule, inner_data_axes
from xshard.config.optimizers import OPTIMIZER_RULES
from xshard.config.ranges import check_args
from xshard.config.sections import check_kwargs
from xshard.config.targets import check_nested_targets, instantiate_nested, resolve_target
from xshard.errors import ConfigError
from xshard.optim.hyperparams import FactoryCall
from xshard.schedules import check_schedule

KEY = "reduction.axes"


def outer_optimizer(node: Mapping[str, Any], key: str, allowed: Sequence[str]) -> FactoryCall:
    """The factory call of an ``outer_optimizer`` node (``_target_`` and arguments, an
    argument a ``_target_`` node of its own, e.g. a ``learning_rate`` schedule), checked
    (built once): ``call(values)`` builds the optax optimizer with `values` (by config key,
    ``<key>.<argument>``) in place of the config's (`xshard.optim.hyperparams`); an argument
    built from a node of its own stays a constant.

    Raises:
      ConfigError: naming ``<key>._target_`` or ``<key>.<argument>`` for a target that is not
        allowed or not found, a key that is not an argument, a value out of range, a
        ``learning_rate`` node that does not build a schedule, or a target that does not
        build an optax transformation.
    """
    kwargs = dict(node)
    target = kwargs.pop("_target_")
    fn = resolve_target(target, allowed, key=f"{key}._target_")
    check_kwargs(fn, kwargs, key, target)
    check_nested_targets(kwargs, key, allowed)  # every target by name, before any import
    nodes = {k for k, v in kwargs.items() if isinstance(v, Mapping) and "_target_" in v}
    plain = {k: v for k, v in kwargs.items() if k not in nodes}
    check_args(OPTIMIZER_RULES, plain, key)  # learning_rate, momentum, ...: by name
    for name in nodes:
        where = f"{key}.{name}"
        kwargs[name] = instantiate_nested(kwargs[name], where, allowed)
        if name == "learning_rate":
            kwargs[name] = check_schedule(kwargs[name], node[name]["_target_"], where)
    call = FactoryCall(fn, kwargs, key, target)
    try:
        tx = call({})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({target}): {e}") from e
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(
            f"{key}._target_={target!r} built a {type(tx).__name__}, not an optax "
            "optimizer; name one such as optax.sgd."
        )
    return call


def _check_on_mesh(
    name: str, conf: AxisReductionConf, shape: Mapping[str, int], data_axes: Sequence[str]
) -> None:
    key = f"{KEY}.{name}"
    if name not in shape:
        raise ConfigError(
            f"{key}: the mesh has no axis {name!r}; its axes are {list(shape)} (shape "
            f"{dict(shape)}). Choose a mesh with it (e.g. mesh=cpu2x4_slices) or another "
            "reduction."
        )
    if conf.periodic:
        inner_data_axes(data_axes, name, KEY)
    size = shape[name]
    if conf.rule == "adasum" and size & (size - 1):
        raise ConfigError(
            f"{key}.rule=adasum: Adasum needs a power-of-two axis, and {name!r} has size "
            f"{size}; use rule=mean or another mesh."
        )


def axis_rules(
    axes: Mapping[str, AxisReductionConf],
    shape: Mapping[str, int] | None,
    data_axes: Sequence[str],
    allowed: Sequence[str],
) -> dict[str, AxisRule]:
    """The `AxisRule` of every ``reduction.axes`` node, checked against the mesh; a periodic
    one's ``outer_optimizer`` is its checked `FactoryCall` (`xshard.optim.factory` builds it).

    Args:
      axes: the parsed nodes (`xshard.config.schemas.ReductionConf.axes`), by axis name.
      shape: the mesh's ``{axis: size}``; None: the mesh is not known (only the nodes'
        own rules were checked).
      data_axes: the mesh's data axes.
      allowed: the ``_target_`` allowlist for the outer optimizers.

    Raises:
      ConfigError: naming ``reduction.axes.<axis>`` (or a key under it) and what is allowed.
    """
    rules = {}
    for name, conf in axes.items():
        if shape is not None:
            _check_on_mesh(name, conf, shape, data_axes)
        outer = conf.outer_optimizer
        if outer is not None:
            outer = outer_optimizer(outer, f"{KEY}.{name}.outer_optimizer", allowed)
        fields = {f.name: getattr(conf, f.name) for f in dataclasses.fields(AxisRule)}
        rules[name] = AxisRule(**(fields | {"outer_optimizer": outer}))
    return rules
