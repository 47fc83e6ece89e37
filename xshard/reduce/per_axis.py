"""The every-step reduction of `xshard.cross_shard` per mesh axis: which axes reduce by the
reduction's mode, which by their own `xshard.config.axes.AxisRule`, and the state they keep.

With ``cross_shard(..., axes={"slice": AxisRule(...)})`` the per-shard gradient is reduced in
one step as follows:

1. over the data axes without a rule, by the reduction's mode (``psum``/``pmean``, as without
   `axes`);
2. then over the axis with an every-step rule (``not rule.periodic``; at most one), by
   its rule (``mean``, ``sum`` or ``adasum``; None: the mode) and codec. The gradient is now
   the same on the devices of the axes of step 1 (its *inner* axes), so ``mean`` and ``sum``
   reduce hierarchically (`xshard.reduce.hierarchical`): each of those devices reduces its share
   over the rule's axis, plainly or through the codec
   (`xshard.reduce.compressed.compressed_all_reduce`), and the shares are all-gathered over the
   inner axes; ``adasum`` reduces the whole gradient from every device
   (`xshard.reduce.adasum.adasum_all_reduce`: its dot products need all of it);
3. an axis with a periodic rule (``rule.periodic``: local SGD, DiLoCo) takes no part: no
   collective of the step crosses it (its parameters are synced by a separate step).

Each every-step axis keeps an `AxisCommState` in the cross-shard state: its error-feedback
residuals (a row per device, one per share: sharded over that axis and the inner axes,
`state_partition_specs`), the compression error norm and the bytes one device sends over the
axis per step, which the trainer logs as ``comm/<axis>/compression_error_norm`` and
``comm/<axis>/bytes_per_step``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from xshard.config.axes import AxisRule, check_rules
from xshard.config.reduction import Reduction
from xshard.reduce.adasum import adasum_all_reduce, adasum_bytes_sent
from xshard.reduce.compressed import tree_size
from xshard.reduce.hierarchical import (
    hierarchical_all_reduce,
    residual_spec,
    share_size,
    slow_bytes_sent,
)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["residual", "error_norm", "bytes_sent"],
    meta_fields=["inner_axes"],
)
@dataclasses.dataclass(frozen=True)
class AxisCommState:
    """What an every-step axis rule keeps in the `cross_shard` state.

    Attributes:
      residual: the error-feedback residuals, float32 ``(axis size, F, share length)``:
        ``[i, j]`` the share of device ``j`` of replica ``i`` (F the devices of the inner
        axes; sharded over the axis and the inner axes: `state_partition_specs`);
        `optax.EmptyState` without error feedback.
      error_norm: float32, the root mean square over the axis's replicas of their compression
        error norms on the last step (0 for a lossless codec).
      bytes_sent: float32, bytes one device sends over the axis per step.
      inner_axes: the axes whose devices share the reduction (static: not an array).
    """

    residual: jax.Array | optax.EmptyState
    error_norm: jax.Array
    bytes_sent: jax.Array
    inner_axes: tuple[str, ...] = ()


def _check_axes(axes: Mapping[str, AxisRule], data_axes: tuple[str, ...]) -> None:
    """Refuses rules `cross_shard` cannot run, naming ``axes.<axis>`` (the config names the
    same keys ``reduction.axes.<axis>``: `xshard.config.axes.check_rules`)."""
    for axis, rule in axes.items():
        if not isinstance(rule, AxisRule):
            raise ValueError(f"axes.{axis} must be an xshard.config.axes.AxisRule, got {rule!r}.")
        if axis not in data_axes:
            raise ValueError(
                f"axes.{axis}: {axis!r} is not one of the reduction's axes {list(data_axes)}."
            )
    check_rules(axes, "axes")


@dataclasses.dataclass(frozen=True)
class AxisReductions:
    """The axis rules of a `cross_shard`, checked.

    Attributes:
      rules: the every-step rules, ``(axis, rule)`` in the order given.
      periodic: the axes with a periodic rule (no collective over them in the step).
      inner_axes: the axes the every-step rules' reductions share out (`mode_axes`: their
        devices hold the same gradient after step 1).
    """

    rules: tuple[tuple[str, AxisRule], ...] = ()
    periodic: tuple[str, ...] = ()
    inner_axes: tuple[str, ...] = ()

    @classmethod
    def build(
        cls, axes: Mapping[str, AxisRule] | None, data_axes: tuple[str, ...]
    ) -> AxisReductions:
        """Checks `axes` (``cross_shard``'s argument) against the reduction's `data_axes`.

        Raises:
          ValueError: naming the axis, for a rule of the wrong type, an axis that is not a data
            axis, an unknown codec or rule name, Adasum with a lossy codec, or every-step rules
            on more than one axis.
        """
        if axes is None:
            return cls()
        _check_axes(axes, data_axes)
        every = tuple((a, r) for a, r in axes.items() if not r.periodic)
        out = cls(every, tuple(a for a, r in axes.items() if r.periodic))
        return dataclasses.replace(out, inner_axes=out.mode_axes(data_axes))

    def step_axes(self, data_axes: tuple[str, ...]) -> tuple[str, ...]:
        """The axes a step's collectives cross: `data_axes` less the periodic ones."""
        return tuple(a for a in data_axes if a not in self.periodic)

    def mode_axes(self, data_axes: tuple[str, ...]) -> tuple[str, ...]:
        """The axes reduced by the reduction's mode: `step_axes` less those with a rule."""
        ruled = {a for a, _ in self.rules}
        return tuple(a for a in self.step_axes(data_axes) if a not in ruled)

    def init(self, params: Any) -> dict[str, AxisCommState] | optax.EmptyState:
        """Zero state per every-step axis, sized from the mesh in context (``jax.set_mesh``).

        Raises:
          ValueError: where no mesh with the axis is in context.
        """
        if not self.rules:
            return optax.EmptyState()
        mesh = jax.sharding.get_abstract_mesh()
        size = tree_size(params)
        out = {}
        for axis, rule in self.rules:
            inner_axes = self.inner_axes
            if mesh.empty or any(a not in mesh.shape for a in (axis, *inner_axes)):
                raise ValueError(
                    f"cross_shard(axes={{{axis!r}: ...}}).init needs the mesh in context "
                    "(jax.set_mesh(mesh)) to size its per-replica state over that axis."
                )
            n = mesh.shape[axis]
            inner = math.prod(mesh.shape[a] for a in inner_axes)
            residual: jax.Array | optax.EmptyState = optax.EmptyState()
            if _feeds_back(rule):
                share = share_size(size, n, inner, rule.comm_dtype or "float32")
                residual = jnp.zeros((n, inner, share), jnp.float32)
            sent = jnp.float32(_bytes_sent(rule, size, n, inner))
            out[axis] = AxisCommState(residual, jnp.zeros((), jnp.float32), sent, inner_axes)
        return out

    def reduce(self, tree: Any, mode: Reduction, comm: Any) -> tuple[Any, dict[str, AxisCommState]]:
        """Step 2 of the module docstring, inside ``shard_map`` (the axes manual): `tree` reduced
        over every rule's axis, and the new `AxisCommState` per axis."""
        if not isinstance(comm, dict) or set(comm) != {a for a, _ in self.rules}:
            raise ValueError(
                "cross_shard with every-step axis rules needs its state's comm field in "
                "reduce(..., comm=state.comm) (the error-feedback residuals)."
            )
        new = {}
        for axis, rule in self.rules:
            tree, new[axis] = _reduce_axis(tree, axis, rule, mode, comm[axis])
        return tree, new


def _feeds_back(rule: AxisRule) -> bool:
    """Whether the rule keeps a residual: error feedback with a lossy codec."""
    return rule.error_feedback and rule.comm_dtype not in (None, "float32")


def _rule_name(rule: AxisRule, mode: Reduction) -> str:
    return rule.rule if rule.rule is not None else mode.value


def _bytes_sent(rule: AxisRule, size: int, n: int, inner: int) -> int:
    """Bytes one device sends over the rule's axis (of `n` replicas, `inner` devices each)."""
    if rule.rule == "adasum":
        return adasum_bytes_sent(size, 4, n)
    return slow_bytes_sent(size, n, inner, rule.comm_dtype or "float32")


def _reduce_axis(
    tree: Any, axis: str, rule: AxisRule, mode: Reduction, state: AxisCommState
) -> tuple[Any, AxisCommState]:
    """`tree` reduced over `axis` by `rule`, and the axis's new state."""
    name = _rule_name(rule, mode)
    if name == "adasum":
        return adasum_all_reduce(tree, axis), state
    residual = None
    if isinstance(state.residual, jax.Array):
        residual = state.residual.reshape(state.residual.shape[-2:])  # this device's row
    out = hierarchical_all_reduce(
        tree,
        axis,
        state.inner_axes,
        comm_dtype=rule.comm_dtype,
        rule=name,
        residual=residual,
        inner_manual=True,
    )
    new_residual: jax.Array | optax.EmptyState = state.residual
    if out.residual is not None:
        new_residual = out.residual[None]
    error_norm = jnp.sqrt(out.error_sq)
    return out.value, dataclasses.replace(state, residual=new_residual, error_norm=error_norm)


def state_partition_specs(opt_state: Any) -> Any:
    """A tree like `opt_state` (or its shapes) of PartitionSpecs: `residual_spec` for the
    residual of the `AxisCommState` of `axis` (a row per device), ``P()`` for every other leaf:
    the state's specs in a ``shard_map`` over the data axes, and the data-axis part of its
    shardings at rest."""

    def spec(path: Any, node: Any) -> Any:
        if isinstance(node, AxisCommState):
            axis = path[-1].key  # the state's key in the dict of axes
            where = residual_spec(axis, node.inner_axes)
            residual = jax.tree.map(lambda _: where, node.residual)
            return AxisCommState(residual, P(), P(), node.inner_axes)  # type: ignore[arg-type]
        return P()

    return jax.tree_util.tree_map_with_path(
        spec, opt_state, is_leaf=lambda x: isinstance(x, AxisCommState)
    )
