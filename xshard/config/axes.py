"""How one mesh axis reduces (`AxisRule`), and its config node ``reduction.axes.<axis name>``.

A synchronous mean over every data axis at every step is what XLA already does best. An
`AxisRule` lets one named mesh axis (e.g. the DCN axis ``slice`` of a multi-slice mesh) choose
otherwise:

- **when**: ``every_steps`` and ``outer_optimizer`` make the axis *periodic* (local SGD,
  DiLoCo): replicas over the axis train alone and a separate sync step reduces the
  pseudo-gradient (outer params minus replica params) and applies the outer optax optimizer;
- **how many bits**: ``comm_dtype`` names the codec of what crosses the axis, and
  ``error_feedback`` keeps the codec's residual in state and adds it to the next message;
- **by what rule**: ``rule`` is ``mean``, ``sum`` or ``adasum`` (None: the reduction's mode).

In a config, a node per axis, keyed by the mesh axis name (`AxisReductionConf`, the fields of
`AxisRule`)::

    reduction:
      axes:
        slice:                 # the DCN axis of mesh=cpu2x4_slices
          every_steps: 8       # periodic: replicas over `slice` train alone for 8 steps
          outer_optimizer:     # then the pseudo-gradient goes through this optax optimizer
            _target_: optax.sgd
            learning_rate: 0.7
            momentum: 0.9
            nesterov: true
          comm_dtype: int8     # the codec of what crosses the axis
          error_feedback: true # the codec's residual is kept and added to the next message

Every rule that needs no mesh is written once, here (`check_rule`, `check_rules`), for
`xshard.cross_shard(axes=...)` and the config alike, and checked when the node is read
(`check_axes`); a periodic axis against the data axes in `inner_data_axes`. What needs the
mesh (the axis exists, an Adasum axis has a power-of-two size) is checked in
`xshard.optim.axis_factory`, which also builds the outer optimizer. Each error is one line
naming the key, the value and what is allowed. JAX-free, like every schema: the codecs, Adasum
and the periodic sync live in `xshard.reduce`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from xshard.config.elastic_groups import ElasticConf, check_elastic
from xshard.config.nodes import shown
from xshard.config.ranges import Range
from xshard.errors import ConfigError

# The codecs a rule may name (``comm_dtype``); xshard.reduce.codecs implements exactly these.
CODEC_NAMES: tuple[str, ...] = ("float32", "bfloat16", "int8", "int4", "float8_e4m3fn")
# The rules by which an axis combines what its replicas send.
RULE_NAMES: tuple[str, ...] = ("mean", "sum", "adasum")


@dataclass(frozen=True)
class AxisRule:
    """How one mesh axis reduces: when, in how many bits, by what rule. The one declaration
    of these fields: the config's node (`AxisReductionConf`) is a copy of it.

    Attributes:
      every_steps: steps between syncs of a periodic axis (1: every step).
      outer_optimizer: the optax optimizer a periodic axis applies to the reduced
        pseudo-gradient (None with ``every_steps == 1``: the axis reduces gradients every step).
      comm_dtype: codec name of what crosses the axis (one of `CODEC_NAMES`), None for none.
      error_feedback: keep the codec's residual in state and add it to the next message.
      fragments: parameter fragments a periodic axis syncs on a staggered schedule.
      rule: ``mean``, ``sum`` or ``adasum`` (one of `RULE_NAMES`); None: the reduction's mode.
      warmup_steps: synchronous steps of a periodic axis before its replicas train alone
        (PyTorch's ``start_localSGD_iter``): until then the gradient is reduced over the axis
        every step too.
      sync_delay: tau, Streaming DiLoCo's delay: the inner steps a fragment's replicas take
        between sending their pseudo-gradient (at its sync step t) and the outer update it
        feeds (after step t + tau); 0: at once. Less than ``every_steps``.
      mix: alpha, Streaming DiLoCo's mixing factor: after the outer update each replica
        sets the fragment to ``mix * replica + (1 - mix) * outer``; 0: the outer params.
      overlap: run the ``sync_delay`` inner steps after a fragment's send and its outer
        update as ONE program, the collective independent of the steps
        (`trainers.core.periodic.window`); needs `window_fits`.
    """

    every_steps: int = 1
    outer_optimizer: Any = None
    comm_dtype: str | None = None
    error_feedback: bool = False
    fragments: int = 1
    rule: str | None = None
    warmup_steps: int = 0
    sync_delay: int = 0
    mix: float = 0.0
    overlap: bool = False

    @property
    def periodic(self) -> bool:
        """Whether the axis syncs parameters in a separate step instead of reducing gradients
        (it has an outer optimizer; `check_rule` refuses the periodic fields without one)."""
        return self.outer_optimizer is not None


def window_fits(rule: AxisRule) -> bool:
    """Whether a fragment's delay window (the ``sync_delay`` steps after its send and its
    outer update) holds no other sync of the axis: ``0 < sync_delay < every_steps //
    fragments`` (the shortest gap between two fragments' sync steps). Reads the fields only:
    `rule` may be the config's node."""
    return 0 < rule.sync_delay < rule.every_steps // rule.fragments


#: The rules a periodic axis may reduce its pseudo-gradient by.
PERIODIC_RULES: tuple[str, ...] = ("mean",)
#: The fields only a periodic axis has, with the value that means "not periodic".
_PERIODIC_ONLY = (
    ("every_steps", 1),
    ("fragments", 1),
    ("warmup_steps", 0),
    ("sync_delay", 0),
    ("mix", 0.0),
    ("overlap", False),
)
#: What a periodic axis inside a population (``hydra/launcher=population``) does not support
#: yet (its key, the value that means "off"): their programs are not rounds over the trials'
#: stacked states (docs/sweeps.md); a job with one trains alone.
POPULATION_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("fragments", 1),
    ("sync_delay", 0),
    ("warmup_steps", 0),
    ("comm_dtype", None),
    ("error_feedback", False),
    ("elastic", None),
)
#: The numeric fields and their ranges (the counts bounded by the int32 step counter); the
#: config's node leaves their type to these (a non-number is one line naming the range too).
RANGES = {
    "every_steps": Range("the steps between syncs (1: every step)", 1, integer=True),
    "fragments": Range("the parameter fragments synced in turn", 1, integer=True),
    "warmup_steps": Range("the synchronous steps before the first local one", integer=True),
    "sync_delay": Range(
        "the inner steps between a fragment's send and its outer update (< every_steps)",
        integer=True,
    ),
    "mix": Range("the share of the replica's own params kept at a sync", 0, 1, high_closed=True),
}
#: What the first ``outer_optimizer`` could be, for the messages.
_AVERAGING = "{_target_: optax.sgd, learning_rate: 1.0} (parameter averaging)"


def _ranges(rule: AxisRule) -> dict[str, Range]:
    """`RANGES`, ``sync_delay`` bounded by the rule's ``every_steps`` once that is valid (a
    fragment's outer update lands before its next send)."""
    if not RANGES["every_steps"].allows(rule.every_steps):
        return RANGES
    return RANGES | {"sync_delay": dataclasses.replace(RANGES["sync_delay"], high=rule.every_steps)}


def check_rule(rule: AxisRule, key: str) -> None:
    """Checks one axis's rule on its own, for `xshard.cross_shard` (``axes.<axis>``) and the
    config (``reduction.axes.<axis>``) alike: the one place these rules are written.

    Args:
      rule: the rule (or the config's node, whose ``outer_optimizer`` is still a node).
      key: its name in the messages, e.g. ``reduction.axes.slice``.

    Raises:
      ConfigError: (a ValueError) naming ``<key>.<field>``, its value and what is allowed.
    """
    for name, allowed in _ranges(rule).items():
        allowed.check(getattr(rule, name), f"{key}.{name}")
    if rule.fragments > rule.every_steps:
        raise ConfigError(
            f"{key}.fragments={rule.fragments}: expected at most {key}.every_steps="
            f"{rule.every_steps} (each fragment syncs once per period, on its own step)."
        )
    if rule.comm_dtype is not None and rule.comm_dtype not in CODEC_NAMES:
        raise ConfigError(
            f"{key}.comm_dtype={shown(rule.comm_dtype)}: expected null or a codec, one of "
            f"{list(CODEC_NAMES)}."
        )
    if rule.rule is not None and rule.rule not in RULE_NAMES:
        raise ConfigError(
            f"{key}.rule={shown(rule.rule)}: expected null or one of {list(RULE_NAMES)}."
        )
    if rule.error_feedback and rule.comm_dtype is None:
        raise ConfigError(
            f"{key}.error_feedback=true needs {key}.comm_dtype (a codec, one of "
            f"{list(CODEC_NAMES)}): without one nothing is lost to feed back."
        )
    if rule.outer_optimizer is not None:
        if rule.rule is not None and rule.rule not in PERIODIC_RULES:
            raise ConfigError(
                f"{key}.rule={shown(rule.rule)}: a periodic axis (with {key}.outer_optimizer) "
                f"reduces its pseudo-gradient by one of {list(PERIODIC_RULES)} or null."
            )
        if rule.overlap and not window_fits(rule):
            raise ConfigError(
                f"{key}.overlap=true: expected 0 < {key}.sync_delay < every_steps // "
                f"fragments ({rule.every_steps} // {rule.fragments}), got sync_delay="
                f"{rule.sync_delay} (the delayed steps and the sync run as one program)."
            )
        return
    for name, default in _PERIODIC_ONLY:
        value = getattr(rule, name)
        if value != default:
            raise ConfigError(
                f"{key}.{name}={value}: only a periodic axis has it; set {key}.outer_optimizer "
                f"(e.g. {_AVERAGING}), or {key}.{name}={default}."
            )
    if rule.rule == "adasum" and rule.comm_dtype not in (None, "float32"):
        raise ConfigError(
            f"{key}.comm_dtype={shown(rule.comm_dtype)}: rule adasum runs in float32 on the "
            f"wire; set {key}.comm_dtype to null or float32, or {key}.rule to mean or sum."
        )


def check_rules(rules: Mapping[str, AxisRule], key: str) -> None:
    """Checks every axis's rule (`check_rule`, as ``<key>.<axis>``) and the set of them: one
    periodic axis at most (its replicas hold one copy of the params each), one every-step rule
    at most (a first axis's error-feedback state would vary over the second).

    Raises:
      ConfigError: naming the first bad key.
    """
    for axis, rule in rules.items():
        check_rule(rule, f"{key}.{axis}")
    periodic = [axis for axis, rule in rules.items() if rule.outer_optimizer is not None]
    if len(periodic) > 1:
        raise ConfigError(
            f"{key}: {periodic} are all periodic (have an outer_optimizer); one periodic axis "
            "per run is supported."
        )
    every = [axis for axis, rule in rules.items() if rule.outer_optimizer is None]
    if len(every) > 1:
        raise ConfigError(
            f"{key}: {every} all reduce by their own rule every step; at most one axis may "
            "(the others reduce by reduction.mode; give one of them an outer_optimizer or "
            "remove it)."
        )


def inner_data_axes(
    data_axes: Sequence[str], periodic: str | None, key: str = "reduction.axes"
) -> tuple[str, ...]:
    """The data axes a replica reduces its gradient over every step: all of them but the
    periodic axis (`periodic`; None: there is none). The one place a periodic axis is checked
    against the data axes, for the config and for a `Trainer` built in Python alike.

    Raises:
      ConfigError: naming ``<key>.<periodic>``, for a periodic axis that is not a data axis or
        is the only one.
    """
    data_axes = tuple(data_axes)
    if periodic is None:
        return data_axes
    inner = tuple(a for a in data_axes if a != periodic)
    if periodic not in data_axes or not inner:
        raise ConfigError(
            f"{key}.{periodic}: a periodic axis must be a data axis and not the only one (its "
            "replicas train on their own data and reduce their gradient over the others every "
            f"step), mesh.data_axes={list(data_axes)}."
        )
    return inner


def _node_of(rule: type[AxisRule]) -> type:
    """A mutable copy of the dataclass `rule` (same fields, types and defaults, and its
    ``periodic``), for Hydra and `xshard.config.read_node` to merge a node into: OmegaConf
    cannot write into a frozen dataclass nested in another. The fields with a range
    (`RANGES`) are typed ``Any``: `check_rule` reads them, so that a non-number is its one line
    naming the range (exit 2), not a composition error. The node adds ``elastic``
    (`xshard.config.elastic_groups.ElasticConf`, null: off), which the trainer reads, not the
    rule."""
    fields = [
        (f.name, Any if f.name in RANGES else f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(rule)
    ]
    fields.append(("elastic", ElasticConf | None, dataclasses.field(default=None)))
    node = dataclasses.make_dataclass(
        "AxisReductionConf",
        fields,
        namespace={"periodic": rule.periodic, "__doc__": "The config node of an `AxisRule`."},
    )
    node.__module__ = __name__
    return node


if TYPE_CHECKING:  # to a type checker the node is the rule it is read into
    AxisReductionConf = AxisRule
else:
    AxisReductionConf = _node_of(AxisRule)


def check_axes(axes: Mapping[str, AxisReductionConf], key: str = "reduction.axes") -> None:
    """Checks every node of ``reduction.axes`` (read as `AxisReductionConf`s) by its key, and
    the set of them (`check_rules`: one periodic axis, one every-step rule). Each node's outer
    optimizer must be a node with a ``_target_``; the rest of its rules are `check_rule`'s,
    which `xshard.cross_shard` checks too.

    Raises:
      ConfigError: for the first bad node or key, naming it.
    """
    for name, conf in axes.items():
        node = conf.outer_optimizer
        has_target = isinstance(node, dict) and isinstance(node.get("_target_"), str)
        if node is not None and not has_target:
            raise ConfigError(
                f"{key}.{name}.outer_optimizer={shown(node)}: expected null or an optax "
                "optimizer node with a _target_, e.g. {_target_: optax.sgd, learning_rate: 1.0} "
                "(parameter averaging)."
            )
        check_rule(conf, f"{key}.{name}")
        check_elastic(getattr(conf, "elastic", None), f"{key}.{name}.elastic", conf)
    check_rules(axes, key)
