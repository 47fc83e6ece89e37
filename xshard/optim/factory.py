"""Config -> optimizer: the inner optax optimizer, its schedule, clipping and `cross_shard`.

`build_optimizer` reads the ``optimizer``, ``schedule``, ``reduction`` and ``clip`` nodes of a
composed config (a ``DictConfig`` or a plain dict) and returns::

    cross_shard(                      # per-shard clip -> reduce -> non-finite guard
        chain(xshard.reduce.clipping.clip_by_global_norm(clip),   # only if clip is set
              inject_hyperparams(optax.<optimizer>)(learning_rate=<schedule>, ...)),
        reduction.mode, axis_name=..., clip_per_shard=..., comm_dtype=..., skip_nonfinite=...,
        axes={<axis>: AxisRule(...)})  # the every-step rule of reduction.axes, if any

The global clip sits inside `cross_shard`, so the non-finite guard covers it. It clips as
`optax.clip_by_global_norm` does and records the norms and whether it fired in its state
(`xshard.reduce.clipping.GlobalClipState`), for the trainer's clipping statistics. Only
``learning_rate`` is injected as a hyperparameter (every other argument is passed statically),
so the current rate is in the state: ``optax.tree_utils.tree_get(state, "learning_rate")`` or
``xshard.get_hyperparams(state)["learning_rate"]``; it is set from the schedule before each
update (`xshard.optim.learning_rate`; no schedule: the base rate).

Every float of these nodes can also be an input of a compiled program rather than a constant:
`build_optimizer_with_rules` returns the config's values and a builder of the same optimizer
from other values (`xshard.optim.hyperparams.Hyperparams`; which keys:
`xshard.config.program_inputs`).

Targets (``optimizer._target_``, ``schedule._target_``, dotted mask paths) are resolved by
`xshard.config.targets.resolve_target`: a public class or function defined under ``optax.``,
``xshard.schedules.``, ``trainers.tasks.`` or an entry of ``allowed_targets``. Every bad value
raises `ConfigError` naming the key, the value and what is allowed.

``reduction.axes`` (`build_optimizer_with_rules` returns their rules too): the every-step
rule (Adasum, a codec with error feedback) goes to ``cross_shard(axes=...)``; the periodic one
(local SGD, DiLoCo) is left out of the step (``axis_name`` leaves its axis out) and runs in the
trainer's sync step.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import optax
from omegaconf import DictConfig

from xshard.config import read_node
from xshard.config.axes import AxisRule
from xshard.config.optimizers import OPTIMIZER_RULES, check_optimizer_args
from xshard.config.program_inputs import CLIP_KEY, CLIP_RULE, lifted, lifted_values
from xshard.config.schedule_schemas import SCHEDULE_RULES
from xshard.config.schemas import ReductionConf, reduction_kwargs
from xshard.config.sections import as_config, check_kwargs, mapping, section
from xshard.config.targets import ALLOWED_TARGETS_KEY, allowed_prefixes, resolve_target
from xshard.errors import ConfigError
from xshard.mesh.build import check_axis_names
from xshard.mesh.spec import data_axes as mesh_data_axes
from xshard.optim.axis_factory import axis_rules
from xshard.optim.cross_shard import CrossShardTransformation, cross_shard
from xshard.optim.hyperparams import FactoryCall, Hyperparams
from xshard.optim.learning_rate import required_target, schedule_call, schedule_of, scheduled
from xshard.optim.masks import resolve_mask
from xshard.optim.schedule_free import check_schedule_free
from xshard.reduce.clipping import clip_by_global_norm

#: Config mask keys, and the optax argument names they may go to (adamw/lamb/lion say `mask`;
#: optax.contrib.muon's rule of which parameters it orthogonalises is a mask too).
MASK_ARGS = {
    "weight_decay_mask": ("weight_decay_mask", "mask"),
    "trust_ratio_mask": ("trust_ratio_mask",),
    "muon_mask": ("muon_weight_dimension_numbers",),
}

# --------------------------------------------------------------------------------------------
# Config values
# --------------------------------------------------------------------------------------------


def _learning_rate(opt: dict[str, Any]) -> float:
    if "learning_rate" not in opt:
        raise ConfigError(
            "optimizer.learning_rate is required: the base (peak) learning rate, a number > 0."
        )
    check_optimizer_args({"learning_rate": opt["learning_rate"]})
    return opt["learning_rate"]


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


def build_schedule(cfg: Any) -> optax.Schedule:
    """Builds the learning-rate schedule: the ``schedule`` node applied to the base rate.

    Args:
      cfg: a config node with an ``optimizer`` child (for ``optimizer.learning_rate``) and an
        optional ``schedule`` child (``_target_`` plus its arguments; null: constant rate).

    Returns:
      An optax schedule, ``step -> learning rate``.

    Raises:
      ConfigError: for a missing or bad learning rate or schedule value, naming the key.
    """
    cfg = as_config(cfg)
    lr = _learning_rate(mapping(section(cfg, "optimizer", required=True), "optimizer"))
    allowed = allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))
    call = schedule_call(lr, section(cfg, "schedule", required=False), allowed)
    return optax.constant_schedule(lr) if call is None else call({}, lr)


# --------------------------------------------------------------------------------------------
# Inner optimizer
# --------------------------------------------------------------------------------------------


def _inner_optimizer(
    node: dict[str, Any],
    learning_rate: float,
    schedule: FactoryCall | None,
    allowed: tuple[str, ...],
    schedule_target: str = "",
) -> FactoryCall:
    """The ``optimizer`` node's factory call, checked: ``inject_hyperparams(<target>)`` whose
    learning rate is the scheduled one (`_scheduled`), the other arguments static."""
    kwargs = dict(node)
    target = required_target(kwargs, "optimizer")
    fn = resolve_target(target, allowed, key="optimizer._target_")
    del kwargs["_target_"], kwargs["learning_rate"]
    check_schedule_free(fn, kwargs, schedule_of({}, learning_rate, schedule), schedule_target)
    params = inspect.signature(fn).parameters
    if "learning_rate" not in params:
        raise ConfigError(
            f"optimizer._target_={target!r} has no learning_rate argument; xshard passes the "
            "scheduled rate there. Use an optax optimizer such as optax.adamw."
        )
    if isinstance(kwargs.get("mask"), str):
        raise ConfigError(
            f"optimizer.mask={kwargs['mask']!r}: name masks with optimizer.weight_decay_mask."
        )
    masks = [key for key, candidates in MASK_ARGS.items() if any(c in params for c in candidates)]
    for key, candidates in MASK_ARGS.items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        arg = next((c for c in candidates if c in params), None)
        if arg is None:
            raise ConfigError(f"optimizer.{key}: {target} takes no such mask; remove the key.")
        if value is not None:  # null: keep optax's default, i.e. every parameter
            kwargs[arg] = resolve_mask(value, allowed, key=f"optimizer.{key}")
    check_kwargs(
        fn,
        kwargs,
        "optimizer",
        target,
        supplied=("learning_rate",),
        other_keys=("_target_", "learning_rate", *masks),
    )
    check_optimizer_args(kwargs)  # b1, eps, weight_decay, ...: the schemas' rules, by name
    # Inject only the learning rate: other arguments may drive Python control flow or shapes
    # (adafactor's min_dim_size_to_factor) and must stay static; the float ones are inputs of
    # the step all the same (`Hyperparams`), passed to the factory as traced values.
    static = [
        n
        for n, p in params.items()
        if n != "learning_rate"
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    injected = optax.inject_hyperparams(fn, static_args=static)
    return FactoryCall(injected, kwargs, "optimizer", target)


# --------------------------------------------------------------------------------------------
# Reduction
# --------------------------------------------------------------------------------------------


def _data_axes(cfg: DictConfig) -> tuple[str, ...]:
    """The mesh's data axes (``mesh.data_axes`` of the config, else ``data``)."""
    mesh_node = section(cfg, "mesh", required=False)
    return mesh_data_axes(mesh_node) if mesh_node is not None else ("data",)


def _reduction(cfg: DictConfig) -> ReductionConf:
    """The ``reduction`` node (`ReductionConf`); a null ``axis_name`` becomes the mesh's data
    axes but a periodic one (``reduction.axes``): its replicas do not reduce every step."""
    conf = read_node(ReductionConf, section(cfg, "reduction", required=True), "reduction")
    periodic = [name for name, axis in conf.axes.items() if axis.periodic]
    if conf.axis_name is None:
        conf.axis_name = tuple(a for a in _data_axes(cfg) if a not in periodic)
    elif set(periodic) & set(conf.axis_name):
        raise ConfigError(
            f"reduction.axis_name={list(conf.axis_name)} names the periodic axis "
            f"{periodic[0]!r} (reduction.axes.{periodic[0]}.outer_optimizer is set), which "
            "is synced every_steps steps, never every step; leave it out (or null)."
        )
    return conf


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


class BuiltOptimizer(NamedTuple):
    """The optimizer a config describes and the rules of its mesh axes, from one read of it.

    Attributes:
      tx: the cross-shard optimizer (`build_optimizer`).
      axis_rules: the `AxisRule` of every ``reduction.axes.<axis>`` node, by axis name; a
        periodic rule holds its built outer optax optimizer (``tx`` holds the every-step one).
      hyperparams: the config's float hyperparameters and how to build `tx` and `axis_rules`
        with other values of them (`xshard.optim.hyperparams.Hyperparams`: the trainer's
        step programs take them as inputs); None in a `BuiltOptimizer` it built.
    """

    tx: CrossShardTransformation
    axis_rules: dict[str, AxisRule]
    hyperparams: Hyperparams | None = None

    @property
    def periodic(self) -> tuple[str, AxisRule] | None:
        """The periodic axis and its rule (at most one: `xshard.config.axes.check_axes`), or
        None."""
        found = [(name, rule) for name, rule in self.axis_rules.items() if rule.periodic]
        return found[0] if found else None


def build_optimizer(cfg: Any, mesh: Any = None) -> CrossShardTransformation:
    """Builds the cross-shard optimizer described by a config.

    Args:
      cfg: a config node (``DictConfig`` or dict) with children ``optimizer`` (``_target_``,
        ``learning_rate`` and the factory's arguments; ``weight_decay_mask`` /
        ``trust_ratio_mask`` name masks such as ``no_bias_no_norm``) and ``reduction``
        (``mode``, ``axis_name``, ``clip_per_shard``, ``comm_dtype``, ``skip_nonfinite``);
        optional ``schedule`` (null: constant rate), ``clip`` (global-norm clip of the reduced
        gradient; null: none) and ``allowed_targets`` (extra ``_target_`` prefixes).
      mesh: optional ``jax.sharding.Mesh`` (or ``AbstractMesh``) the optimizer runs on. If
        given, the reduction axes must be axes of it, and a SUM outside ``shard_map`` scales
        by their size.

    Returns:
      The `xshard.optim.cross_shard.CrossShardTransformation` (an
      ``optax.GradientTransformationExtraArgs``): per-shard clip -> reduce -> non-finite
      guard -> global clip -> inner optimizer with the scheduled learning rate. Its ``spec``
      holds the ``reduction`` node as parsed (e.g. the mode as an `xshard.Reduction`).

    Raises:
      ConfigError: for a missing required key, an unknown reduction mode, a learning rate
        <= 0, a ``_target_`` that is not allowed or not found, an argument the target does not
        take, or reduction axes that are not mesh axes; the message names the key, the value
        and the allowed values.
    """
    return build_optimizer_with_rules(cfg, mesh).tx


def build_optimizer_with_rules(cfg: Any, mesh: Any = None) -> BuiltOptimizer:
    """`build_optimizer`, with the rules of ``reduction.axes`` it read on the way: the
    ``reduction`` node is read once and each outer optimizer built once.

    Args:
      cfg, mesh: as `build_optimizer`'s; given the mesh, each ``reduction.axes`` axis must be
        one of its axes (a periodic one a data axis, an Adasum one of power-of-two size).

    Returns:
      The optimizer and the axis rules (`BuiltOptimizer`).

    Raises:
      ConfigError: as `build_optimizer`, naming ``reduction.axes.<axis>`` or the key under
        it for a bad axis rule.
    """
    cfg = as_config(cfg)
    allowed = allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))
    opt = mapping(section(cfg, "optimizer", required=True), "optimizer")
    red = _reduction(cfg)
    lr = _learning_rate(opt)
    schedule = schedule_call(lr, section(cfg, "schedule", required=False), allowed)
    clip = section(cfg, "clip", required=False)
    CLIP_RULE.check(clip, CLIP_KEY)

    shape = None if mesh is None else dict(mesh.shape)
    rules = axis_rules(red.axes, shape, _data_axes(cfg), allowed)
    for name, rule in rules.items():
        if not rule.periodic and name not in red.axis_name:
            raise ConfigError(
                f"reduction.axes.{name}: {name!r} reduces every step by its own rule, so it "
                f"must be one of reduction.axis_name={list(red.axis_name)}; add it there "
                "(or leave reduction.axis_name null: the mesh's data axes)."
            )
    num_shards = None
    if mesh is not None:
        # Raises MeshConfigError, a ConfigError.
        axes = check_axis_names(mesh, red.axis_name, key="reduction.axis_name")
        num_shards = math.prod(mesh.shape[a] for a in axes)

    schedule_node = section(cfg, "schedule", required=False)
    schedule_target = "" if schedule_node is None else str(schedule_node.get("_target_"))
    inner = _inner_optimizer(opt, lr, schedule, allowed, schedule_target)
    # The periodic axis takes no part in the step (the trainer's sync step reduces over it).
    kwargs = reduction_kwargs(red) | {"num_shards": num_shards}
    parts = _Parts(inner, lr, schedule, clip, kwargs, rules)
    hyperparams = Hyperparams(_inputs(parts), functools.partial(_assemble, parts))
    return hyperparams.build(hyperparams.values)._replace(hyperparams=hyperparams)


class _Parts(NamedTuple):
    """What `build_optimizer_with_rules` read and checked, to build the optimizer from."""

    inner: FactoryCall  # inject_hyperparams(<optimizer._target_>)
    learning_rate: float
    schedule: FactoryCall | None
    clip: float | None
    cross_shard: dict[str, Any]  # the keyword arguments of `cross_shard` but `axes`
    rules: dict[str, AxisRule]  # a periodic one's outer optimizer as its FactoryCall


def _inputs(parts: _Parts) -> dict[str, Any]:
    """The config's values of the optimizer's inputs (`xshard.config.program_inputs`), by key."""
    lr = {"learning_rate": parts.learning_rate}
    values = lifted_values(OPTIMIZER_RULES, lr, "optimizer") | parts.inner.inputs(OPTIMIZER_RULES)
    if parts.schedule is not None:
        values |= parts.schedule.inputs(SCHEDULE_RULES)
    if lifted(CLIP_RULE, parts.clip):
        values[CLIP_KEY] = parts.clip
    for rule in parts.rules.values():
        if rule.periodic:
            values |= rule.outer_optimizer.inputs(OPTIMIZER_RULES)
    return values


def _assemble(parts: _Parts, values: Mapping[str, Any]) -> BuiltOptimizer:
    """The optimizer and axis rules of `parts` with `values` (by config key) in place of the
    config's: `Hyperparams.build`."""
    try:
        injected = parts.inner(values, learning_rate=0.0)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optimizer ({parts.inner.target}): {e}") from e
    inner = scheduled(injected, schedule_of(values, parts.learning_rate, parts.schedule))
    clip = values.get(CLIP_KEY, parts.clip)
    if clip is not None:
        inner = optax.chain(clip_by_global_norm(clip), inner)
    rules = {
        name: replace(rule, outer_optimizer=rule.outer_optimizer(values)) if rule.periodic else rule
        for name, rule in parts.rules.items()
    }
    every_step = {name: rule for name, rule in rules.items() if not rule.periodic}
    tx = cross_shard(inner, **parts.cross_shard, axes=every_step or None)
    return BuiltOptimizer(tx, rules)
