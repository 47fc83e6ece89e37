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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard import reduction_args
from xshard.buckets import psum_scatter_tree, psum_tree
from xshard.clipping import clip_recorded
from xshard.errors import ConfigError
from xshard.reduction_args import axis_names, clip_norm
from xshard.reduction_mode import Reduction
from xshard.stats import when
from xshard.vma import varying_axes

logger = logging.getLogger(__name__)

AxisNames = str | Sequence[str]


class PerShardGradientsRequired(ValueError):
    """Per-shard clipping or weighting was asked for gradients that were already reduced."""


class DoubleReductionError(ValueError):
    """Raised when gradients to reduce are already invariant over the reduction axis."""


def axis_tuple(axis_name: AxisNames) -> tuple[str, ...]:
    """`axis_name` as a tuple of distinct, non-empty axis names (`xshard.reduction_args`).

    Raises:
      ConfigError: for an empty name, an empty tuple or duplicates.
    """
    return axis_names(axis_name)


def _manual_axes(axes: tuple[str, ...]) -> bool:
    """True if every axis in `axes` is manual here (shard_map or pmap); False if none is."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(() if mesh.empty else mesh.manual_axes)
    hits = [a for a in axes if a in manual]
    if hits and len(hits) != len(axes):
        raise ValueError(
            f"Reduction axes {axes!r} are only partly manual here (manual: {tuple(hits)!r}); "
            "put all of them, or none, in the shard_map's manual axes."
        )
    return bool(hits)


def _tracks_varying(axes: tuple[str, ...]) -> bool:
    """Whether the current trace tracks varying-ness (shard_map with check_vma=True).

    Under `pmap` or `shard_map(check_vma=False)` nothing is marked varying, and the gradient of
    replicated params is per shard already, so there is nothing to check.
    """
    probe = jax.lax.pcast(jnp.zeros((), jnp.int32), axes, to="varying")
    return bool(set(axes) & varying_axes(probe))


def _check_per_shard(grads: Any, axes: tuple[str, ...]) -> None:
    if not _tracks_varying(axes):
        return
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        missing = [a for a in axes if a not in varying_axes(g)]
        if missing:
            raise DoubleReductionError(
                f"Gradient leaf {jax.tree_util.keystr(path) or '<root>'} is already invariant over "
                f"mesh axes {tuple(missing)!r}: it was reduced before reaching cross_shard, and "
                "reducing it again would count every shard's contribution N times. Inside "
                "shard_map, jax.grad of a loss w.r.t. replicated params is already summed over "
                "the manual axes. Take per-shard gradients instead: "
                f"params = jax.lax.pcast(params, {axes!r}, to='varying') before jax.grad."
            )


def _require_per_shard(grads: Any, axes: tuple[str, ...], what: str) -> None:
    """Per-shard clipping and weighting need per-shard gradients: inside shard_map, varying."""
    if not _manual_axes(axes):
        raise PerShardGradientsRequired(
            f"{what}: needs per-shard gradients, computed inside jax.shard_map with mesh axes "
            f"{axes!r} manual; these gradients were computed outside it (plain jit / GSPMD), "
            "where no per-shard gradient exists."
        )
    _check_per_shard(grads, axes)


class Reduced(NamedTuple):
    """A reduction's result, possibly with MEAN's division left to its consumers.

    Attributes:
      tree: the reduced gradient, or where `mean_over` > 1 the sum whose mean it is.
      mean_over: the shard count to divide `tree` by (`divide`, ``pmean``'s arithmetic), so
        that XLA fuses the division into each consumer instead of a kernel per leaf; 1: none.
      parts: the summed buffers holding `tree` (packed per dtype, `xshard.buckets.psum_tree`):
        a reduction over the whole gradient reads these, not the leaves; None: the leaves.
      unpack: ``unpack(parts) -> tree`` (`xshard.buckets.Packed.unpack`) where `parts` is
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
    collective (`xshard.buckets.psum_scatter_tree`).

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
        n = _shards_in_context(axes, None)
        return Reduced(packed.tree, n, packed.parts, packed.unpack)
    psum: Callable[[Any, Any], Any]
    pmean: Callable[[Any, Any], Any]
    if not scatter:
        psum, pmean = jax.lax.psum, jax.lax.pmean
    else:

        def psum(tree, axes):  # one reduce-scatter per dtype (xshard.buckets)
            return psum_scatter_tree(tree, scatter_dims, axes)

        def pmean(tree, axes):  # pmean's arithmetic: the sum over the shard count
            return divide(psum(tree, axes), _shards_in_context(axes, None))

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


def _shards_in_context(axes: tuple[str, ...], num_shards: int | None) -> int:
    if num_shards is not None:
        return num_shards
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        logger.warning(
            "cross_shard(reduction='sum') runs outside shard_map with no mesh in context "
            "(jax.set_mesh) and no num_shards=: assuming 1 shard."
        )
        return 1
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise ValueError(
            f"Reduction axis_name {tuple(unknown)!r} is not an axis of the mesh in context "
            f"(axes: {tuple(mesh.axis_names)!r})."
        )
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


# --------------------------------------------------------------------------------------------
# The two transforms before the reduction's summary and guard (see xshard.optimizer)
# --------------------------------------------------------------------------------------------


class PerShardClipState(NamedTuple):
    """State of `per_shard_clip`."""

    clipped_fraction: jax.Array  # f32: share of shards clipped on the last statistics step


def per_shard_clip(
    max_norm: float, axis_name: AxisNames = "data"
) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` of each shard's own gradient, before the reduction.

    TF reduced late for this: one shard's huge gradient must not dominate the others. Must run
    inside ``jax.shard_map`` on per-shard (varying) gradients.

    Args:
      max_norm: the global norm each shard's local gradient is clipped to (> 0).
      axis_name: the data-parallel mesh axis, or axes, the gradients vary over.

    Returns:
      A transformation with state `PerShardClipState`. Its `update` takes the extra
      arguments ``with_stats`` (None, a bool or a traced bool: record the fraction of shards
      that were clipped, one scalar ``pmean``; None: on every update, False: never, NaN).

    Raises:
      ValueError: for a `max_norm` that is not > 0; at update time,
        `PerShardGradientsRequired` outside shard_map and `DoubleReductionError` for
        gradients that are already reduced.
    """
    if clip_norm(max_norm) is None:
        raise ConfigError("clip_per_shard=None: per_shard_clip needs a global norm > 0.")
    axes = axis_tuple(axis_name)

    def init_fn(params):
        del params
        return PerShardClipState(jnp.full((), jnp.nan, jnp.float32))

    def update_fn(updates, state, params=None, *, with_stats=None, **extra):
        del state, params, extra
        _require_per_shard(updates, axes, "clip_per_shard")
        clipped, _, fired = clip_recorded(updates, max_norm)
        fraction = when(with_stats, lambda: jax.lax.pmean(fired.astype(jnp.float32), axes))
        return clipped, PerShardClipState(fraction)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
        name = reduction_args.comm_dtype(comm_dtype)
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
            _require_per_shard(updates, self.axes, "shard_weight")
        if _manual_axes(self.axes):
            _check_per_shard(updates, self.axes)
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
        n = _shards_in_context(self.axes, self.num_shards)
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
