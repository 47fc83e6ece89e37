"""Reduction of gradients across data-parallel shards: the semantics of `xshard.cross_shard`.

`reduce_gradients` is steps 1 and 2 of a `cross_shard` update (per-shard clipping, then the
all-reduce), usable on its own. Where the reduction happens depends on how the gradient was
computed:

* Inside ``jax.shard_map`` with ``axis_name`` manual, the gradient must be *per shard*
  (varying over the axis). ``jax.grad`` of a loss w.r.t. replicated params is already summed
  over the manual axes, so reducing it again would multiply it by the number of shards; that is
  refused with an error. Cast the params first: ``jax.lax.pcast(params, axis, to="varying")``.
  Then SUM is ``psum`` and MEAN is ``pmean`` (TF's "scale the loss by 1/N, then
  cross_replica_sum").
* Outside any manual axis (plain ``jit``, GSPMD) the compiler has already reduced the gradient
  of a global-mean loss: MEAN is the identity and SUM multiplies by the number of shards.

Step 1 is `xshard.reduce.shard_clip`; which case applies (manual axes, per-shard gradients, the
shard count) is read by `xshard.mesh.context`. Their public names are importable from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.config.reduction import Reduction
from xshard.config.reduction import comm_dtype as parse_comm_dtype
from xshard.mesh.collectives import psum_scatter_tree, psum_tree
from xshard.mesh.context import (
    AxisNames,
    DoubleReductionError,
    PerShardGradientsRequired,
    axes_are_manual,
    axis_tuple,
    check_per_shard,
    require_per_shard,
    shards_in_context,
)
from xshard.reduce.shard_clip import PerShardClipState, per_shard_clip

__all__ = [
    "AllReduce",
    "AxisNames",
    "DoubleReductionError",
    "PerShardClipState",
    "PerShardGradientsRequired",
    "Reduced",
    "all_reduce",
    "axis_tuple",
    "divide",
    "per_shard_clip",
    "reduce_gradients",
]


class Reduced(NamedTuple):
    """A reduction's result, possibly with MEAN's division left to its consumers.

    Attributes:
      tree: the reduced gradient, or where `mean_over` > 1 the sum whose mean it is.
      mean_over: the shard count to divide `tree` by (`divide`, ``pmean``'s arithmetic), so
        that XLA fuses the division into each consumer instead of a kernel per leaf; 1: none.
      parts: the summed buffers holding `tree` (packed per dtype,
      `xshard.mesh.collectives.psum_tree`):
        a reduction over the whole gradient reads these, not the leaves; None: the leaves.
      unpack: ``unpack(parts) -> tree`` (`xshard.mesh.collectives.Packed.unpack`) where `parts` is
        set: called where the leaves are consumed, the slicing fuses into the consumers.
    """

    tree: Any
    mean_over: int = 1
    parts: tuple[jax.Array, ...] | None = None
    unpack: Callable[[Sequence[jax.Array]], Any] | None = None


def _all_reduce(
    grads: Any,
    mode: Reduction,
    axes: tuple[str, ...],
    comm_dtype: Any,
    shard_weight: jax.Array | None,
    scatter_dims: Any = None,
    defer_mean: bool = False,
) -> Reduced:
    """psum/pmean (optionally weighted) of every non-None leaf, in `comm_dtype` if given.

    With `scatter_dims` (a tree like `grads` of ints or None), a leaf with an int is
    reduce-scattered along that dimension (``psum_scatter``, tiled: each shard keeps its
    1/N slice, in the order of `axes`) instead of all-reduced, the leaves of one dtype in one
    collective (`xshard.mesh.collectives.psum_scatter_tree`).

    Returns:
      The `Reduced` tree; with `defer_mean`, for a plain MEAN (no weights, no comm dtype, no
      scatter), the psum with its divisor left to apply (`Reduced`).
    """

    def to_comm(g):
        return g.astype(comm_dtype) if comm_dtype is not None else g

    w = None
    if shard_weight is not None:
        w = jnp.asarray(shard_weight, jnp.float32)
        if w.ndim != 0:
            raise ValueError(f"shard_weight must be a scalar per shard, got shape {w.shape}.")
    scatter = scatter_dims is not None and bool(jax.tree.leaves(scatter_dims))
    if defer_mean and mode is Reduction.MEAN and w is None and comm_dtype is None and not scatter:
        packed = psum_tree(grads, axes)
        n = shards_in_context(axes, None)
        return Reduced(packed.tree, n, packed.parts, packed.unpack)
    psum: Callable[[Any, Any], Any]
    pmean: Callable[[Any, Any], Any]
    if not scatter:
        psum, pmean = jax.lax.psum, jax.lax.pmean
    else:

        def psum(tree, axes):  # one reduce-scatter per dtype (xshard.mesh.collectives)
            return psum_scatter_tree(tree, scatter_dims, axes)

        def pmean(tree, axes):  # pmean's arithmetic: the sum over the shard count
            return divide(psum(tree, axes), shards_in_context(axes, None))

    if w is None:
        collective = psum if mode is Reduction.SUM else pmean
        reduced = collective(jax.tree.map(to_comm, grads), axes)
    else:
        reduced = psum(jax.tree.map(lambda g: to_comm(g * w.astype(g.dtype)), grads), axes)
        if mode is Reduction.MEAN:
            total = jax.lax.psum(w, axes)
            reduced = jax.tree.map(lambda g: g / total.astype(g.dtype), reduced)
    return Reduced(jax.tree.map(lambda r, g: r.astype(g.dtype), reduced, grads))


def divide(tree: Any, n: int) -> Any:
    """`tree` divided by the shard count `n` as ``jax.lax.pmean`` divides its psum (the
    identity for 1)."""
    if n == 1:
        return tree
    return jax.tree.map(lambda v: v / n, tree)


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """The reduction across shards with its arguments checked: `all_reduce`'s transform, and
    what `xshard.cross_shard` reduces with (`reduced`, whose MEAN may leave its division to
    the consumers).

    Attributes:
      mode: SUM or MEAN.
      axes: the mesh axes reduced over.
      comm_dtype: the collective's dtype (a `jnp.dtype`), or None: the gradient's own.
      num_shards: the shard count for SUM outside a manual axis, or None: the mesh's.
    """

    mode: Reduction
    axes: tuple[str, ...]
    comm_dtype: Any = None
    num_shards: int | None = None

    @classmethod
    def build(
        cls,
        reduction: Reduction | str = Reduction.MEAN,
        *,
        axis_name: AxisNames = "data",
        comm_dtype: Any = None,
        num_shards: int | None = None,
    ) -> AllReduce:
        """Checks `all_reduce`'s arguments (see there) and returns its `AllReduce`.

        Raises:
          ValueError: for an unknown reduction, bad axis names or a bad `num_shards`.
        """
        mode = Reduction.parse(reduction)
        axes = axis_tuple(axis_name)
        if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
            raise ValueError(f"num_shards must be a positive int or None, got {num_shards!r}.")
        name = parse_comm_dtype(comm_dtype)
        comm = None if name is None else jnp.dtype(name)
        return cls(mode, axes, comm, num_shards)

    def init(self, params: Any) -> optax.EmptyState:
        """The (empty) state."""
        del params
        return optax.EmptyState()

    def reduced(
        self,
        updates: Any,
        *,
        shard_weight: jax.Array | None = None,
        scatter_dims: Any = None,
        defer_mean: bool = False,
    ) -> Reduced:
        """The reduction of `updates` (see `all_reduce`) as a `Reduced`: with `defer_mean`, a
        plain MEAN inside shard_map is the psum and the shard count, the division left to the
        consumers (`divide`)."""
        if shard_weight is not None:
            require_per_shard(updates, self.axes, "shard_weight")
        if axes_are_manual(self.axes):
            check_per_shard(updates, self.axes)
            return _all_reduce(
                updates,
                self.mode,
                self.axes,
                self.comm_dtype,
                shard_weight,
                scatter_dims,
                defer_mean=defer_mean,
            )
        if scatter_dims is not None and any(d is not None for d in jax.tree.leaves(scatter_dims)):
            raise ValueError("scatter_dims needs per-shard gradients inside shard_map.")
        if self.mode is Reduction.MEAN:
            return Reduced(updates)
        n = shards_in_context(self.axes, self.num_shards)
        return Reduced(jax.tree.map(lambda g: g * jnp.asarray(n, g.dtype), updates))

    def update(
        self,
        updates: Any,
        state: optax.EmptyState,
        params: Any = None,
        *,
        shard_weight: jax.Array | None = None,
        scatter_dims: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.EmptyState]:
        """The optax update: the reduced `updates`, and `state` unchanged."""
        del params, extra_args
        out = self.reduced(updates, shard_weight=shard_weight, scatter_dims=scatter_dims)
        return divide(out.tree, out.mean_over), state


def all_reduce(
    reduction: Reduction | str = Reduction.MEAN,
    *,
    axis_name: AxisNames = "data",
    comm_dtype: Any = None,
    num_shards: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The reduction across shards as an optax transform (stateless).

    Inside shard_map: ``psum`` (SUM) or ``pmean`` (MEAN) of per-shard gradients, or with the
    extra update argument ``shard_weight`` (a scalar per shard, e.g. its token count)
    ``psum(w * g)``, divided by ``psum(w)`` for MEAN. The extra argument ``scatter_dims`` (a
    tree like the gradient of ints or None; inside shard_map only) reduce-scatters the leaves
    with an int along that dimension (``psum_scatter``: each shard keeps its slice, ZeRO-2)
    with the same arithmetic. Outside any manual axis (plain jit,
    GSPMD) the gradient is already reduced: MEAN is the identity and SUM multiplies by the
    number of shards (`num_shards`, else the mesh in context).

    Args:
      reduction: `Reduction.SUM` or `Reduction.MEAN` (or "sum"/"mean", any case).
      axis_name: mesh axis, or tuple of axes, to reduce over.
      comm_dtype: dtype of the collective (e.g. ``"bfloat16"``); the result is cast back.
      num_shards: number of shards for SUM outside a manual axis, if no mesh is in context.

    Returns:
      The transform (`AllReduce`'s ``init`` and ``update``).

    Raises:
      ValueError: for an unknown reduction or bad argument; at update time as
        `reduce_gradients`.
    """
    op = AllReduce.build(
        reduction, axis_name=axis_name, comm_dtype=comm_dtype, num_shards=num_shards
    )
    return optax.GradientTransformationExtraArgs(op.init, op.update)


def reduce_gradients(
    grads: Any,
    reduction: Reduction | str = Reduction.MEAN,
    *,
    axis_name: AxisNames = "data",
    clip_per_shard: float | None = None,
    comm_dtype: Any = None,
    shard_weight: jax.Array | None = None,
    num_shards: int | None = None,
) -> Any:
    """Reduces `grads` across shards with the semantics of `cross_shard` (steps 1 and 2).

    `per_shard_clip` (if `clip_per_shard` is set) then `all_reduce`, applied once.

    Args:
      grads: gradient pytree; `None` leaves pass through unreduced.
      reduction: `Reduction.SUM` or `Reduction.MEAN` (or "sum"/"mean").
      axis_name: mesh axis, or tuple of axes, to reduce over.
      clip_per_shard: if set, clip each shard's local gradient to this global norm first.
      comm_dtype: dtype of the collective (e.g. ``jnp.bfloat16``); the result is cast back.
      shard_weight: scalar weight of this shard (e.g. its token count): MEAN becomes
        ``psum(w * g) / psum(w)`` and SUM ``psum(w * g)``.
      num_shards: number of shards for SUM outside a manual axis, if no mesh is in context.

    Returns:
      The reduced gradients, identical on every shard.
    """
    if clip_per_shard is not None:
        clip = per_shard_clip(clip_per_shard, axis_name)
        grads, _ = clip.update(grads, clip.init(grads), with_stats=False)
    reduce = all_reduce(
        reduction, axis_name=axis_name, comm_dtype=comm_dtype, num_shards=num_shards
    )
    return reduce.update(grads, optax.EmptyState(), shard_weight=shard_weight)[0]
