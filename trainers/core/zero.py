"""Where ZeRO / FSDP puts each array: optimizer state, gradients and params over the data axes.

``sharding.zero_stage`` (docs/scaling.md):

* 0 — everything replicated over the data axes (only the task's model-axis rules apply);
* 1 — the optimizer state sharded over the data axes; params replicated at rest;
* 2 — also the reduced gradient: reduce-scattered instead of all-reduced;
* 3 — also the params at rest (FSDP); gathered for the forward and backward pass.

The policy for one array (`zero_dim`): shard the **first dimension whose size divides by the
number of data shards N and that the model-axis rule leaves unsharded**; an array with no such
dimension (a bias of 4 on 8 shards, a scalar) stays replicated over the data axes, and the
start-up report (`sharding_report`) lists it with the bytes it costs per device. The first
such dimension, not the largest, because a slice along the leading dimension is contiguous:
the reduce-scatter and all-gather move it without a transpose. No padding: a padded slice
would change what norms and factored statistics see.

The same rule applies to every optimizer-state leaf by its own shape: adam's ``mu``/``nu``
shard like their parameter, adafactor's factored ``v_row``/``v_col`` by their own dimensions,
counts and hyperparameters stay replicated. GSPMD then computes the inner optimizer on the
slices, and a norm or mean over a sharded array (lamb's trust ratio, global-norm clipping,
adafactor's factored moments) is still taken over the whole array: XLA adds the partial sums.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.transforms import MaskedNode

from trainers.tasks.sharding import param_specs
from xshard.optim.packed import tree_map_params
from xshard.stats.tree import path_str


def _used_axes(spec: P) -> set[str]:
    used: set[str] = set()
    for entry in spec:
        if isinstance(entry, str):
            used.add(entry)
        elif isinstance(entry, tuple | list):
            used.update(entry)
    return used


def zero_dim(shape: Sequence[int], spec: P, num_shards: int) -> int | None:
    """The dimension of an array of `shape` that ZeRO shards over the data axes, or None.

    Args:
      shape: the array's shape.
      spec: its sharding over the model axes (the task's rule; `P()` for none).
      num_shards: N, the number of data shards.

    Returns:
      The first dimension whose size is divisible by `num_shards` and that `spec` leaves
      unsharded; None (replicated over data) if there is none or `num_shards` is 1.
    """
    if num_shards <= 1:
        return None
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    for dim, (size, entry) in enumerate(zip(shape, entries)):
        if entry is None and size >= num_shards and size % num_shards == 0:
            return dim
    return None


def with_data_axes(shape: Sequence[int], spec: P, axes: Sequence[str], num_shards: int) -> P:
    """`spec` with the data `axes` added on `zero_dim` (unchanged if that is None)."""
    dim = zero_dim(shape, spec, num_shards)
    if dim is None or _used_axes(spec) & set(axes):
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    entries[dim] = axes[0] if len(axes) == 1 else tuple(axes)
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class ZeroLayout:
    """The shardings of one run's arrays for a ZeRO stage.

    Args:
      stage: ``sharding.zero_stage``, one of `trainers.config.zero_options.ZERO_STAGES`
        (checked there, once, when the ``sharding`` node is read).
      mesh: the device mesh.
      axes: the data-parallel mesh axes the state is sharded over.
      rules: the task's model-axis sharding rules (`trainers.tasks.sharding`), or a function
        returning them, read when the shardings are needed: a Flax task knows its rules only
        once its model is initialised.
    """

    stage: int
    mesh: Mesh
    axes: tuple[str, ...]
    rules: Any = ()

    def base_shardings(self, params: Any) -> Any:
        """The params' shardings from the task's model-axis `rules` (replicated over data)."""
        rules = self.rules() if callable(self.rules) else self.rules
        specs = param_specs(params, rules, self.mesh.axis_names, dict(self.mesh.shape))
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    @property
    def num_shards(self) -> int:
        """N: the number of data shards."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def spec(self, shape: Sequence[int], spec: P) -> P:
        """The spec of an array of `shape` with model-axis `spec`, sharded over the data axes."""
        return with_data_axes(shape, spec, self.axes, self.num_shards)

    def sharded(self, shapes: Any, shardings: Any) -> Any:
        """`shardings` (NamedShardings of arrays shaped like `shapes`) over the data axes too."""
        return jax.tree.map(
            lambda x, s: NamedSharding(self.mesh, self.spec(np.shape(x), s.spec)), shapes, shardings
        )

    def params_at_rest(self, shapes: Any, shardings: Any) -> Any:
        """The params' shardings between steps: sharded with stage 3, else as the rules say."""
        return self.sharded(shapes, shardings) if self.stage >= 3 else shardings

    def data_dims(self, shapes: Any, shardings: Any) -> Any:
        """Per leaf of `shapes` (model-axis `shardings`): its `zero_dim`, or None."""
        return jax.tree.map(
            lambda x, s: zero_dim(np.shape(x), s.spec, self.num_shards), shapes, shardings
        )

    def scatter_dims(self, shapes: Any, shardings: Any) -> Any:
        """Per gradient leaf: the dimension to reduce-scatter (stage >= 2), or None."""
        dims = self.data_dims(shapes, shardings)
        return dims if self.stage >= 2 else jax.tree.map(lambda _: None, dims)

    def opt_state_shardings(
        self, tx: optax.GradientTransformation, params: Any, param_shardings: Any
    ) -> Any:
        """Shardings of `tx`'s state for `params` (arrays or shape structs).

        A per-parameter leaf shaped like its parameter takes the parameter's model-axis spec;
        one of another shape (adafactor's factored moments) none. Both then get the data axes
        by `zero_dim` (stage >= 1). Everything else (counts, hyperparameters, the cross-shard
        statistics) is replicated. A masked-out leaf of a partitioned state (the Adam half of
        optax.contrib.muon) stays an `optax.MaskedNode`.
        """
        shapes = jax.eval_shape(tx.init, params)
        replicated = NamedSharding(self.mesh, P())

        def per_param(leaf, param: _Param):
            if isinstance(leaf, MaskedNode):
                return leaf
            shape = tuple(np.shape(leaf))
            model = param.sharding.spec if shape == param.shape else P()
            spec = self.spec(shape, model) if self.stage >= 1 else model
            return NamedSharding(self.mesh, spec)

        tagged = jax.tree.map(lambda p, s: _Param(s, tuple(np.shape(p))), params, param_shardings)
        return tree_map_params(
            tx,
            per_param,
            shapes,
            tagged,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, MaskedNode),
        )


@dataclasses.dataclass(frozen=True)
class _Param:
    """A parameter's sharding and shape: a pytree leaf (a state leaf of another shape, such as
    a factored moment, does not take the parameter's model-axis spec)."""

    sharding: NamedSharding
    shape: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# The start-up report
# --------------------------------------------------------------------------------------------


def _shown(spec: P) -> str:
    """`spec` without trailing Nones (``P(None, None)`` and ``P()`` read the same)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return str(P(*entries))


def bytes_per_device(x: Any, sharding: NamedSharding) -> int:
    """Bytes of one device's shard of `x` (an array or a shape struct) laid out by `sharding`."""
    shard = sharding.shard_shape(tuple(np.shape(x)))
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def sharding_report(
    layout: ZeroLayout, params: Any, shardings: Any, opt_state: Any, opt_shardings: Any
) -> str:
    """The one-time start-up report: every parameter's sharding at rest and where its update
    and optimizer state live, the leaves left replicated over the data axes (no dimension
    divisible by N outside the model axes) with the bytes each costs per device, and the
    per-device bytes of params and optimizer state.

    Args:
      layout: the run's `ZeroLayout`.
      params: the params (arrays or shape structs).
      shardings: their shardings at rest.
      opt_state: the optimizer state (arrays or shape structs).
      opt_shardings: its shardings.

    Returns:
      The report, one line per parameter.
    """
    n = layout.num_shards
    base = jax.tree.leaves(layout.base_shardings(params))
    lines = [
        (
            f"sharding.zero_stage={layout.stage} over the data axes {list(layout.axes)} "
            f"({n} shards); per parameter: shape, dtype, sharding at rest, of its update and "
            "optimizer state:"
        )
    ]
    replicated: list[str] = []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), at_rest, b in zip(flat, jax.tree.leaves(shardings), base):
        name, shape = path_str(path), tuple(np.shape(x))
        state_spec = layout.spec(shape, b.spec) if layout.stage >= 1 else b.spec
        lines.append(f"  {name}: {shape} {x.dtype} {_shown(at_rest.spec)} {_shown(state_spec)}")
        if layout.stage >= 1 and n > 1 and zero_dim(shape, b.spec, n) is None:
            cost = bytes_per_device(x, b)
            replicated.append(f"{name} {shape} ({cost} bytes per device, and its state)")
    param_bytes = sum(
        bytes_per_device(x, s) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))
    )
    opt_bytes = sum(
        bytes_per_device(x, s)
        for x, s in zip(jax.tree.leaves(opt_state), jax.tree.leaves(opt_shardings))
    )
    lines.append(f"Per device: params {param_bytes} bytes, optimizer state {opt_bytes} bytes.")
    if replicated:
        lines.append(f"Left replicated over the data axes: {', '.join(replicated)}.")
    return "\n".join(lines)


def state_report(layout: ZeroLayout, state: Any) -> str:
    """`sharding_report` of a `TrainState` (its arrays' own shardings)."""
    return sharding_report(
        layout,
        state.params,
        jax.tree.map(lambda x: x.sharding, state.params),
        state.opt_state,
        jax.tree.map(lambda x: x.sharding, state.opt_state),
    )


def zero_layout(stage: Any, mesh: Mesh, axes: Sequence[str], rules: Any = ()) -> ZeroLayout:
    """The `ZeroLayout` of ``sharding.zero_stage=stage`` over the data `axes` of `mesh`
    (`stage` as `trainers.config.ShardingOptions` checked it)."""
    return ZeroLayout(stage, mesh, tuple(axes), rules if callable(rules) else tuple(rules))
