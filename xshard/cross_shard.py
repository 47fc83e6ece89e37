"""The cross-shard optimizer: reduce gradients across data-parallel shards, then update.

`cross_shard` wraps any optax transformation, the way TensorFlow's TPU `CrossShardOptimizer`
wrapped a `tf.train.Optimizer`. One update does, in order:

1. optional per-shard clipping of each shard's local gradient (the reason TF reduced late:
   one shard's huge gradient must not dominate the others);
2. the reduction across shards (SUM = ``psum``, MEAN = ``pmean``, or a weighted mean);
3. an optional non-finite guard, after the reduction so every shard takes the same decision;
4. the inner optimizer.

Where the reduction happens depends on how the gradient was computed:

* Inside ``jax.shard_map`` with ``axis_name`` manual, the gradient must be *per shard*
  (varying over the axis). ``jax.grad`` of a loss w.r.t. replicated params is already summed
  over the manual axes, so reducing it again would multiply it by the number of shards; that is
  refused with an error. Cast the params first: ``jax.lax.pcast(params, axis, to="varying")``.
* Outside any manual axis (plain ``jit``, GSPMD) the compiler has already reduced the gradient
  of a global-mean loss: MEAN is the identity and SUM multiplies by the number of shards.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.stats import GradSummary, count_nonfinite, guard_summary, summarize

logger = logging.getLogger(__name__)

AxisNames = str | Sequence[str]


class PerShardGradientsRequired(ValueError):
    """Per-shard clipping or weighting was asked for gradients that were already reduced."""


class Reduction(enum.StrEnum):
    """How gradients are combined across shards (TF's `losses.Reduction.SUM`/`MEAN`)."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, value: Reduction | str, *, key: str = "reduction") -> Reduction:
        """Returns the `Reduction` for `value` ("sum"/"mean" in any case, or a member).

        Raises:
          ValueError: naming `key`, the bad value and the allowed values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(
            f"Unsupported {key}: {value!r}. Allowed: {allowed} "
            "(any case) or xshard.Reduction.SUM / xshard.Reduction.MEAN."
        )


class CrossShardState(NamedTuple):
    """State of `cross_shard`: the inner optimizer's state and non-finite step counters."""

    inner_state: optax.OptState
    skipped_steps: jax.Array  # int32: steps skipped because the reduced gradient was not finite
    consecutive_skipped: jax.Array  # int32: skipped steps in a row, reset by a finite step
    reduced: GradSummary  # norm, max |g| and non-finite count of the last reduced gradient


class DoubleReductionError(ValueError):
    """Raised when gradients to reduce are already invariant over the reduction axis."""


def _axis_tuple(axis_name: AxisNames) -> tuple[str, ...]:
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"axis_name must be a non-empty axis name or tuple of names, got {axis_name!r}."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"axis_name has duplicate axes: {names!r}.")
    return names


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


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older JAX spelling


def _tracks_varying(axes: tuple[str, ...]) -> bool:
    """Whether the current trace tracks varying-ness (shard_map with check_vma=True).

    Under `pmap` or `shard_map(check_vma=False)` nothing is marked varying, and the gradient of
    replicated params is per shard already, so there is nothing to check.
    """
    probe = jax.lax.pcast(jnp.zeros((), jnp.int32), axes, to="varying")
    return bool(set(axes) & _varying_axes(probe))


def _check_per_shard(grads: Any, axes: tuple[str, ...]) -> None:
    if not _tracks_varying(axes):
        return
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        missing = [a for a in axes if a not in _varying_axes(g)]
        if missing:
            raise DoubleReductionError(
                f"Gradient leaf {jax.tree_util.keystr(path) or '<root>'} is already invariant over "
                f"mesh axes {tuple(missing)!r}: it was reduced before reaching cross_shard, and "
                "reducing it again would count every shard's contribution N times. Inside "
                "shard_map, jax.grad of a loss w.r.t. replicated params is already summed over "
                "the manual axes. Take per-shard gradients instead: "
                f"params = jax.lax.pcast(params, {axes!r}, to='varying') before jax.grad."
            )


def _clip_to_norm(tree: Any, max_norm: float) -> Any:
    norm = optax.tree.norm(tree)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), tree)


def _all_reduce(
    grads: Any,
    mode: Reduction,
    axes: tuple[str, ...],
    comm_dtype: Any,
    shard_weight: jax.Array | None,
) -> Any:
    """psum/pmean (optionally weighted) of every non-None leaf, in `comm_dtype` if given."""

    def to_comm(g):
        return g.astype(comm_dtype) if comm_dtype is not None else g

    if shard_weight is None:
        collective = jax.lax.psum if mode is Reduction.SUM else jax.lax.pmean
        reduced = collective(jax.tree.map(to_comm, grads), axes)
    else:
        w = jnp.asarray(shard_weight, jnp.float32)
        if w.ndim != 0:
            raise ValueError(f"shard_weight must be a scalar per shard, got shape {w.shape}.")
        summed = jax.lax.psum(jax.tree.map(lambda g: to_comm(g * w.astype(g.dtype)), grads), axes)
        if mode is Reduction.MEAN:
            total = jax.lax.psum(w, axes)
            summed = jax.tree.map(lambda g: g / total.astype(g.dtype), summed)
        reduced = summed
    return jax.tree.map(lambda r, g: r.astype(g.dtype), reduced, grads)


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
    mode = Reduction.parse(reduction)
    axes = _axis_tuple(axis_name)
    if _manual_axes(axes):
        _check_per_shard(grads, axes)
        if clip_per_shard is not None:
            grads = _clip_to_norm(grads, clip_per_shard)
        return _all_reduce(grads, mode, axes, comm_dtype, shard_weight)

    # Outside shard_map: the compiler already reduced the gradient of a global-mean loss.
    if clip_per_shard is not None or shard_weight is not None:
        raise PerShardGradientsRequired(
            "clip_per_shard and shard_weight need per-shard gradients, computed inside "
            f"jax.shard_map with mesh axes {axes!r} manual; these gradients were computed "
            "outside it (plain jit / GSPMD), where no per-shard gradient exists."
        )
    if mode is Reduction.MEAN:
        return grads
    n = _shards_in_context(axes, num_shards)
    return jax.tree.map(lambda g: g * jnp.asarray(n, g.dtype), grads)


def cross_shard(
    inner: optax.GradientTransformation,
    reduction: Reduction | str = Reduction.MEAN,
    *,
    axis_name: AxisNames = "data",
    clip_per_shard: float | None = None,
    comm_dtype: Any = None,
    skip_nonfinite: bool = False,
    num_shards: int | None = None,
    track_stats: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps `inner` so that gradients are reduced across data-parallel shards first.

    Args:
      inner: any optax transformation (extra arguments are forwarded to it).
      reduction: `Reduction.SUM`/`Reduction.MEAN` or "sum"/"mean" in any case.
      axis_name: the mesh axis, or tuple of axes (e.g. ``("dcn_data", "data")``), to reduce
        over. A factored mesh such as ``(replica, data)`` reduced over ``data`` only gives
        per-group reductions (TF's ``group_assignment``).
      clip_per_shard: clip each shard's local gradient to this global norm before reducing.
      comm_dtype: dtype for the collective (e.g. ``"bfloat16"``); results are cast back.
      skip_nonfinite: if the reduced gradient has a NaN/Inf, leave params and inner state
        unchanged on every shard (zero updates) and count the step in the state.
      num_shards: shard count for SUM outside shard_map when no mesh is in context.
      track_stats: record the norm, max |g| and non-finite count of the reduced gradient in
        ``state.reduced`` (`xshard.stats.GradSummary`), for logging without a second pass.

    Returns:
      An `optax.GradientTransformationExtraArgs`. Its `update` accepts the extra keyword
      ``shard_weight`` (a scalar per shard) for a weighted reduction, and ``with_stats`` (a
      bool, may be traced): when false, `track_stats` records only max |g| and the
      non-finite count (the norm is NaN), saving a reduction per leaf on steps that log
      nothing. Every other extra argument is forwarded to `inner`.

    Raises:
      ValueError: at construction for an unknown reduction or bad clip value; at update time
        (`DoubleReductionError`) when gradients are already reduced over the axis.
    """
    mode = Reduction.parse(reduction)
    axes = _axis_tuple(axis_name)
    if clip_per_shard is not None and not clip_per_shard > 0:
        raise ValueError(f"clip_per_shard must be > 0 or None, got {clip_per_shard!r}.")
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards must be a positive int or None, got {num_shards!r}.")
    comm = None if comm_dtype is None else jnp.dtype(comm_dtype)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # Distinct buffers: a donated state must not alias one array twice.
        return CrossShardState(
            inner.init(params),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            GradSummary(
                jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
            ),
        )

    def update_fn(updates, state, params=None, *, shard_weight=None, with_stats=None, **extra_args):
        reduced = reduce_gradients(
            updates,
            mode,
            axis_name=axes,
            clip_per_shard=clip_per_shard,
            comm_dtype=comm,
            shard_weight=shard_weight,
            num_shards=num_shards,
        )
        if track_stats and with_stats is not None:  # the norm only when asked, in one program
            summary = jax.lax.cond(with_stats, summarize, guard_summary, reduced)
        elif track_stats:
            summary = summarize(reduced)
        elif skip_nonfinite:
            summary = state.reduced._replace(nonfinite=count_nonfinite(reduced))
        else:
            summary = state.reduced

        def apply_inner(inner_state):
            return inner.update(reduced, inner_state, params, **extra_args)

        if not skip_nonfinite:
            new_updates, new_inner = apply_inner(state.inner_state)
            return new_updates, state._replace(inner_state=new_inner, reduced=summary)

        def skip(inner_state):  # zero updates, state untouched
            shapes = jax.eval_shape(apply_inner, inner_state)[0]
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state

        # The reduced gradient is identical on every shard, so every shard decides alike. A
        # cond (not a select) also lets XLA update the donated state in place.
        finite = summary.nonfinite == 0
        new_updates, new_inner = jax.lax.cond(finite, apply_inner, skip, state.inner_state)
        return new_updates, CrossShardState(
            new_inner,
            state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
            jnp.where(finite, 0, state.consecutive_skipped + 1).astype(jnp.int32),
            summary,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
