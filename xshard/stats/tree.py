"""Gradient statistics computed on device, inside the compiled step.

* `when` — a computation on statistics steps only: a Python bool decides at trace time (a
  separate executable per value), a traced bool under a `lax.cond` (one executable).
* `leaf_sq_norms`, `tree_max_abs`, `count_nonfinite` — what `xshard.guard` summarizes a
  gradient pytree with (`GradSummary`); `split_over_shards` divides the work on a tensor
  every shard holds (a reduced gradient) among the shards.
* `noise_scale` — the gradient noise scale B_simple of McCandlish et al. (2018), "An
  Empirical Model of Large-Batch Training", Appendix A: from the squared norm of the gradient
  at a small batch (one shard's, b examples) and at the big batch (the mean over shards, B
  examples), unbiased estimates of |G|^2 and tr(Sigma) and their ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp


class GradSummary(NamedTuple):
    """Scalars describing one gradient pytree, and the norm of each of its leaves."""

    norm: jax.Array  # global L2 norm (float32)
    max_abs: jax.Array | None  # largest |g| (float32); None until a step measures it
    nonfinite: jax.Array  # number of NaN/Inf elements (int32)
    #: f32[L]: L2 norm of every leaf, in jax.tree.leaves order; None until a step measures it
    leaf_norms: jax.Array | None


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)


Flag = bool | jax.Array | None


def when(flag: Flag, compute: Callable[[], Any], otherwise: Callable[[], Any] | None = None):
    """`compute()` where `flag` holds, `otherwise()` (default: NaN of the same shapes) elsewhere.

    Args:
      flag: None or True: always compute; False: never (decided at trace time, nothing of
        `compute` is in the program); a traced bool: both under one `lax.cond`, so both
        values of the flag share one executable.
      compute: returns a pytree of arrays.
      otherwise: returns a pytree of the same structure, shapes and dtypes.

    Returns:
      The pytree of the branch taken.
    """
    if otherwise is None:
        otherwise = lambda: nan_like(jax.eval_shape(compute))
    if flag is None or flag is True:
        return compute()
    if flag is False:
        return otherwise()
    return jax.lax.cond(flag, compute, otherwise)


def nan_like(shapes: Any) -> Any:
    """NaN (zeros for integer and bool dtypes) of the shapes and dtypes of `shapes`, varying
    over the same manual axes (inside shard_map) as the abstract values they replace."""

    def fill(aval):
        floating = jnp.issubdtype(aval.dtype, jnp.inexact)
        value = jnp.full(aval.shape, jnp.nan if floating else 0, aval.dtype)
        mat = getattr(aval, "manual_axis_type", None)
        varying = tuple(sorted(getattr(mat, "varying", ()) or ()))
        return jax.lax.pcast(value, varying, to="varying") if varying else value

    return jax.tree.map(fill, shapes)


#: Fewest elements (all leaves together) for which splitting a statistic over the shards
#: (`split_over_shards`) paid on 8 simulated CPU devices (docs/benchmarks.md): below them the
#: collective that joins the parts costs more than reading the whole tensor on every shard.
#: Per-leaf sums of squares: between tiny_gpt's 0.11M (slower split) and 6.3M (faster);
#: histograms, a scatter-add per value: between mlp's 5.5K and tiny_gpt's 0.11M.
SPLIT_MIN_ELEMENTS = {"sq_norms": 1 << 20, "histograms": 1 << 16}


def worth_splitting(tree: Any, statistic: str) -> bool:
    """Whether `statistic` (a key of `SPLIT_MIN_ELEMENTS`) of `tree` is worth splitting over
    the shards: `tree` holds at least that many elements."""
    size = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree))
    return size >= SPLIT_MIN_ELEMENTS[statistic]


def split_over_shards(
    tree: Any, axes: Sequence[str]
) -> tuple[list[jax.Array], list[jax.Array | None]]:
    """This shard's part of every leaf of `tree`, flat, for a tensor every shard holds alike.

    Inside ``shard_map`` with `axes` manual, a statistic of a replicated tensor (a reduced
    gradient) need not be computed N times: each shard reads its 1/N of every leaf whose size
    divides by N, and a collective over `axes` adds up (or maxes) the parts. A leaf that does
    not divide is read whole by every shard, with weight 1 on the first shard and 0 on the
    others, so that sums count it once.

    Returns:
      (parts, weights): float32 vectors, and None (an even part) or a bool scalar weight.
    """
    axes = tuple(axes)
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    me = jax.lax.axis_index(axes)
    parts: list[jax.Array] = []
    weights: list[jax.Array | None] = []
    for x in jax.tree.leaves(tree):
        v = _f32(x).reshape(-1)
        if v.size % n == 0:
            parts.append(jax.lax.dynamic_index_in_dim(v.reshape(n, -1), me, keepdims=False))
            weights.append(None)
        else:
            parts.append(v)
            weights.append(me == 0)
    return parts, weights


def leaf_sq_norms(tree: Any, shard_axes: Sequence[str] | None = None) -> jax.Array:
    """f32[L]: the sum of squares of every leaf of `tree` (in float32; `None` leaves are not
    leaves). NaN or Inf where a leaf holds one, or where its squares overflow.

    `shard_axes`: inside ``shard_map``, axes over which `tree` is the same on every shard:
    each shard sums its part (`split_over_shards`), one ``psum`` adds them up.
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    if not shard_axes:
        return jnp.stack([jnp.sum(jnp.square(_f32(g))) for g in leaves])
    parts, weights = split_over_shards(leaves, shard_axes)
    sums = [
        jnp.sum(jnp.square(p)) if w is None else jnp.where(w, jnp.sum(jnp.square(p)), 0.0)
        for p, w in zip(parts, weights, strict=True)
    ]
    return jax.lax.psum(jnp.stack(sums), tuple(shard_axes))


def tree_sq_norm(tree: Any) -> jax.Array:
    """The squared global L2 norm of `tree` in float32 (0 for an empty tree).

    Where reductions are kernels of their own (`xshard.mesh.collectives.packs_by_default`: XLA:CPU,
    which also splits a small reduction into three), the leaves are flattened into one
    buffer first: one concatenation and one reduction instead of up to three per leaf. Only
    where every mesh axis is manual (inside shard_map) or there is no mesh: under GSPMD a
    leaf may be sharded, and concatenating it would gather it.
    """
    from xshard.mesh.collectives import packs_by_default

    leaves = [_f32(x).reshape(-1) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    mesh = jax.sharding.get_abstract_mesh()
    local = mesh.empty or set(mesh.manual_axes) == set(mesh.axis_names)
    if packs_by_default() and local and len(leaves) > 1:
        return jnp.sum(jnp.square(jnp.concatenate(leaves)))
    # `leaves` is not empty: the sum is an array, never sum()'s start value 0.
    return cast(jax.Array, sum(jnp.sum(jnp.square(x)) for x in leaves))


def tree_max_abs(tree: Any) -> jax.Array:
    """Largest |x| over the leaves of `tree` (float32; 0 for an empty tree; NaN-propagating)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.stack([jnp.max(jnp.abs(_f32(g)), initial=0.0) for g in leaves]))


def finite_values(tree: Any) -> Any:
    """`tree` with its NaN and Inf elements replaced by 0."""
    return jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, jnp.zeros_like(g)), tree)


def count_nonfinite(tree: Any) -> jax.Array:
    """Number of NaN/Inf elements in `tree` (int32; 0 for an empty tree)."""
    return sum(
        (jnp.sum(~jnp.isfinite(g), dtype=jnp.int32) for g in jax.tree.leaves(tree)),
        jnp.zeros((), jnp.int32),
    )


def tree_norm(tree: Any) -> jax.Array:
    """Global L2 norm of a pytree in float32 (0 for an empty tree; `tree_sq_norm`)."""
    return jnp.sqrt(tree_sq_norm(tree))


def noise_scale(
    small_sq_norm: jax.Array, big_sq_norm: jax.Array, b_small: int, b_big: int
) -> dict[str, jax.Array]:
    """Unbiased |G|^2 and tr(Sigma) estimates and B_simple = tr(Sigma) / |G|^2.

    Args:
      small_sq_norm: E[|G_small|^2], the mean squared norm of per-shard mean gradients.
      big_sq_norm: |G_big|^2, the squared norm of the mean gradient over all shards.
      b_small: examples per shard; b_big: examples in the global batch (> b_small).

    Returns:
      ``noise_grad_sq`` (|G|^2), ``noise_trace`` (tr Sigma) and ``noise_scale`` (B_simple,
      NaN where |G|^2 <= 0). Single-step estimates are noisy: average them over steps (the
      trainer logs a ratio of moving averages too).
    """
    if b_big <= b_small:
        raise ValueError(f"noise_scale needs b_big > b_small, got {b_big} and {b_small}.")
    grad_sq = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    trace = (small_sq_norm - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
    scale = jnp.where(grad_sq > 0, trace / jnp.where(grad_sq > 0, grad_sq, 1.0), jnp.nan)
    return {"noise_grad_sq": grad_sq, "noise_trace": trace, "noise_scale": scale}


def layer_norms(tree: Any) -> dict[str, jax.Array]:
    """L2 norm of every leaf, keyed by its path joined with '/' (e.g. 'blocks/0/attn/wq')."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[path_str(path)] = jnp.sqrt(jnp.sum(jnp.square(_f32(leaf))))
    return out


def path_names(path: Sequence[Any]) -> list[str]:
    """['a', '0', 'b'] for a pytree key path (DictKey, SequenceKey, GetAttrKey, ...)."""
    return [jax.tree_util.keystr((k,), simple=True) for k in path]


def path_str(path: Sequence[Any]) -> str:
    """'a/0/b' for a pytree key path: the parameter names of logs and sharding rules."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def finite_range(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(min, max) of the finite values of the flat `v` (+inf, -inf where there are none)."""
    finite = jnp.isfinite(v)
    lo = jnp.min(jnp.where(finite, v, jnp.inf), initial=jnp.inf)
    hi = jnp.max(jnp.where(finite, v, -jnp.inf), initial=-jnp.inf)
    return lo, hi


def histogram_buckets(lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The histogram's (min, max) from `finite_range`'s: 0 for no finite value, and a
    nonempty interval for a single one."""
    lo, hi = jnp.where(lo <= hi, lo, 0.0), jnp.where(lo <= hi, hi, 0.0)
    return lo, jnp.where(hi > lo, hi, lo + 1e-12)


def histogram_sums(
    v: jax.Array, lo: jax.Array, hi: jax.Array, bins: int, weight: jax.Array | None = None
) -> jax.Array:
    """f32[3 + bins]: the count, sum and sum of squares of the finite values of the flat `v`,
    and their counts in `bins` equal buckets over [lo, hi] (from `histogram_buckets`); all
    times `weight` (a 0/1 scalar) if given. Sums over parts of a tensor add up to its own.

    A value's bucket is computed from its offset (one pass and a scatter-add), not searched
    among the edges as `jnp.histogram` does (a binary search per value, several passes on
    XLA:CPU); the last bucket includes the maximum.
    """
    finite = jnp.isfinite(v)
    ones = finite.astype(jnp.float32) if weight is None else finite * weight.astype(jnp.float32)
    # One value (or lo + 1e-12 == lo in float32): everything in the first bucket.
    scale = jnp.where(hi > lo, bins / (hi - lo), 0.0)
    bucket = jnp.floor((jnp.where(finite, v, lo) - lo) * scale).astype(jnp.int32)
    counts = jnp.zeros((bins,), jnp.float32).at[jnp.clip(bucket, 0, bins - 1)].add(ones)
    clean = jnp.where(finite, v, 0.0) * (1.0 if weight is None else weight.astype(jnp.float32))
    moments = jnp.stack([jnp.sum(ones), jnp.sum(clean), jnp.sum(clean * jnp.where(finite, v, 0.0))])
    return jnp.concatenate([moments, counts])


def bucket_limits(lo: jax.Array, hi: jax.Array, bins: int) -> jax.Array:
    """f32[bins]: the upper edges of `bins` equal buckets over [lo, hi]."""
    return lo + (hi - lo) * (jnp.arange(1, bins + 1, dtype=jnp.float32) / bins)


def histogram(x: jax.Array, bins: int = 64) -> dict[str, jax.Array]:
    """A histogram of the finite values of `x`, in the fields TensorBoard's raw histogram needs
    (`histogram_sums` over `bins` equal buckets between the finite min and max)."""
    v = _f32(x).reshape(-1)
    lo, hi = histogram_buckets(*finite_range(v))
    sums = histogram_sums(v, lo, hi, bins)
    return {
        "min": lo,
        "max": hi,
        "num": sums[0],
        "sum": sums[1],
        "sum_squares": sums[2],
        "bucket_limits": bucket_limits(lo, hi, bins),
        "bucket_counts": sums[3:],
    }
