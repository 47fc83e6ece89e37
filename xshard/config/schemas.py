"""Structured-config schemas of the config groups users compose: optimizer, schedule,
reduction, mesh. Registered in Hydra's ConfigStore by the ``xshard_searchpath`` plugin.

Each YAML option under ``conf/<group>`` starts from one of these dataclasses through its
defaults list and states only what differs from it, e.g. ``conf/optimizer/adamw.yaml``::

    defaults:
      - /xshard_schemas/optimizer@_here_: adamw
      - _self_
    learning_rate: 1e-3

so a typo in a key fails at composition, before any JAX code runs. The optimizer's and the
reduction's schemas are registered as typed (a value of the wrong type fails at composition
too, in Hydra's words: ``reduction.skip_nonfinite=maybe``); the schedule's and the mesh's as
permissive copies (`CHECKED_WHEN_READ`), whose values are checked when the node is read, one
line and exit 2 like the trainer's nodes (``schedule.warmup_steps=3e9``). Values out of range
fail when the node is read: the optimizer's arguments by the rules of
`xshard.config.optimizers` (``optimizer.b1=2``), the schedule's by those of
`xshard.config.schedule_schemas` (``schedule.end_factor=nan``), the reduction's in `ReductionConf`.
The schemas live in their own ConfigStore group (``xshard_schemas/...``) so they never show up
as options of the user-facing groups, e.g. in an ``optimizer=glob(*)`` sweep.

Every default here equals the default of the function the node feeds (the optax factory,
`xshard.schedules`, `xshard.cross_shard`, `xshard.mesh.spec.mesh_spec`), except where
``DEVIATIONS`` says why not; ``tests/config/test_config_defaults.py`` checks that. This module
imports neither JAX nor optax: Hydra's plugin scan imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from xshard.config.axes import AxisReductionConf, check_axes
from xshard.config.nodes import permissive, shown
from xshard.config.optimizers import (
    AdafactorConf,
    AdagradConf,
    AdamConf,
    AdamWConf,
    AdoptConf,
    LambConf,
    LarsConf,
    LionConf,
    MuonConf,
    RMSPropConf,
    ScheduleFreeAdamWConf,
    SGDConf,
)
from xshard.config.reduction import Reduction, axis_names, clip_norm, comm_dtype
from xshard.config.schedule_schemas import (
    ConstantScheduleConf,
    CosineScheduleConf,
    ExponentialScheduleConf,
    WarmupCosineScheduleConf,
    WarmupLinearScheduleConf,
)
from xshard.errors import ConfigError

SCHEMA_GROUP = "xshard_schemas"

# --------------------------------------------------------------------------------------------
# reduction/: the keyword arguments of xshard.cross_shard (`mode` is its `reduction`).
# --------------------------------------------------------------------------------------------


@dataclass
class ReductionConf:
    """How gradients are combined across data-parallel shards (see `xshard.cross_shard`)."""

    mode: str = "mean"  # "sum" or "mean", any case; read as a `xshard.Reduction`
    axis_name: Any = None  # a mesh axis or a list of them; null: the mesh's data axes
    clip_per_shard: float | None = None  # clip each shard's gradient to this global norm
    comm_dtype: str | None = None  # dtype of the all-reduce, e.g. bfloat16
    skip_nonfinite: bool = True  # a NaN/Inf reduced gradient skips the step on every shard
    # Per mesh axis: how often, in how many bits, by what rule (xshard.config.axes).
    axes: dict[str, AxisReductionConf] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Validated and parsed here, once: `xshard.cross_shard` receives the `Reduction`.
        try:
            self.mode = Reduction.parse(self.mode, key="reduction.mode")
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in Reduction)
            raise ConfigError(
                f"Unsupported reduction.mode: {shown(self.mode)}. Allowed: {allowed} (any case)."
            ) from None
        # The rules of the library's keywords, with the config's keys in their messages.
        if self.axis_name is not None:
            self.axis_name = axis_names(self.axis_name, key="reduction.axis_name")
        self.clip_per_shard = clip_norm(self.clip_per_shard, key="reduction.clip_per_shard")
        self.comm_dtype = comm_dtype(self.comm_dtype, key="reduction.comm_dtype")
        check_axes(self.axes)


# --------------------------------------------------------------------------------------------
# mesh/: read by xshard.mesh.spec.mesh_spec, whose defaults fill whatever is null here.
# --------------------------------------------------------------------------------------------


@dataclass
class MeshConf:
    """A device mesh: axes and their sizes within a slice (ici) and across slices (dcn)."""

    name: str | None = None
    topology: str | None = None  # e.g. 2x2x1; informational
    num_devices: int | None = None  # null: whatever JAX sees
    axes: list[str] = field(default_factory=lambda: ["data"])
    ici: list[int] | None = None  # null: -1 on the first axis, 1 elsewhere
    dcn: list[int] | None = None  # null: 1 on every axis
    axis_types: Any = "auto"  # auto | explicit, or one per axis
    simulate_on_cpu: bool = False  # dry-run on num_devices simulated CPU devices
    data_axes: list[str] | None = None  # null: the first axis


@dataclass
class TPUMeshConf(MeshConf):
    """The base of the TPU presets: data parallelism, and a model axis of size 1 to widen."""

    axes: list[str] = field(default_factory=lambda: ["data", "model"])
    ici: list[int] | None = field(default_factory=lambda: [-1, 1])
    dcn: list[int] | None = field(default_factory=lambda: [1, 1])


def reduction_kwargs(conf: ReductionConf) -> dict[str, Any]:
    """`conf` as keyword arguments of `xshard.cross_shard` (``mode`` is its ``reduction``),
    without ``axes``: `xshard.optim.factory` turns those into `xshard.AxisRule`s."""
    kwargs = dict(vars(conf))
    kwargs["reduction"] = kwargs.pop("mode")
    del kwargs["axes"]
    return kwargs


#: Where a schema default differs from the default of the function it feeds, and why.
DEVIATIONS: dict[str, str] = {
    "weight_decay_mask": "xshard decays no biases, norm scales or 0-D/1-D params by default",
    "trust_ratio_mask": "as weight_decay_mask: no trust ratio for biases and norm scales",
    "dtype_momentum": "a dtype name in YAML ('float32') for optax's jnp.float32",
    "muon_mask": (
        "muon_weight_dimension_numbers by rule: optax's default orthogonalises every 2-D "
        "param, embeddings and the output layer included; hidden_matrices keeps those on Adam"
    ),
    "skip_nonfinite": (
        "the trainer skips non-finite steps by default; the library's cross_shard does not "
        "(as TF's CrossShardOptimizer, and so that it is exactly the inner optimizer)"
    ),
    "axis_name": "null: the mesh's data axes, which the library cannot know",
    "axes": (
        "per-axis rules: the every-step ones go to cross_shard, the periodic one (local SGD, "
        "DiLoCo) to the trainer's sync step (xshard.optim.factory.build_optimizer_with_rules)"
    ),
}


SCHEMAS: dict[str, dict[str, type]] = {
    "optimizer": {
        "sgd": SGDConf,
        "adam": AdamConf,
        "adamw": AdamWConf,
        "lamb": LambConf,
        "lars": LarsConf,
        "lion": LionConf,
        "adafactor": AdafactorConf,
        "rmsprop": RMSPropConf,
        "adagrad": AdagradConf,
        "muon": MuonConf,
        "schedule_free_adamw": ScheduleFreeAdamWConf,
        "adopt": AdoptConf,
    },
    "schedule": {
        "constant": ConstantScheduleConf,
        "cosine": CosineScheduleConf,
        "warmup_cosine": WarmupCosineScheduleConf,
        "warmup_linear": WarmupLinearScheduleConf,
        "exponential": ExponentialScheduleConf,
    },
    "reduction": {"base": ReductionConf},
    "mesh": {"base": MeshConf, "tpu": TPUMeshConf},
}

#: The groups whose values composition leaves to the checks that read the node (one line and
#: exit 2 naming the key, as for the trainer's nodes: ``schedule.warmup_steps=3e9``,
#: ``mesh.num_devices=1e6``): Hydra gets permissive copies of their schemas, checked by the
#: schedule's rules (`xshard.config.schedule_schemas`) and `xshard.mesh.spec`. The reduction stays
#: typed: a permissive copy would lose the keys and defaults of ``reduction.axes.<axis>``.
CHECKED_WHEN_READ = ("schedule", "mesh")


def register_schemas(cs: ConfigStore | None = None, schemas: dict[str, Any] | None = None) -> None:
    """Stores every schema as ``xshard_schemas/<group>/<name>`` (idempotent).

    Args:
      cs: the ConfigStore (Hydra's instance by default).
      schemas: ``{group: {name: dataclass}}`` (default `SCHEMAS`, the library's groups).
    """
    cs = cs or ConfigStore.instance()
    for group, options in (SCHEMAS if schemas is None else schemas).items():
        for name, node in options.items():
            stored = permissive(node) if group in CHECKED_WHEN_READ else node
            cs.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=stored, provider="xshard")
