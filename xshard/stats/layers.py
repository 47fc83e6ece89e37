"""Per-leaf statistics of a gradient, stacked into a few arrays, and the transform that records
its histograms in an optimizer state.

The per-leaf *norms* of the reduced gradient cost nothing extra: `xshard.stats.tree.summarize`
takes them from the sums of squares it computes for the global norm (``GradSummary.leaf_norms``,
on every statistics step). The *histograms* need a pass of their own, so `summarize_histograms`
computes them only on the steps that ask (extra update argument ``histograms``). Either way a
trainer logs per-layer statistics of the applied gradient without a second forward and
backward pass. The arrays are stacked over the leaves, in `jax.tree.leaves` order, so the state
holds a handful of small arrays whatever the model (and `optax.tree_map_params` never mistakes
them for per-parameter state).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xshard.stats.tree import (
    bucket_limits,
    finite_range,
    histogram_buckets,
    histogram_sums,
    nan_like,
    path_str,
    split_over_shards,
    when,
)

#: Buckets of every gradient histogram.
HISTOGRAM_BINS = 64


_SCALARS = ("min", "max", "num", "sum", "sum_squares")


class Histograms(NamedTuple):
    """One histogram per leaf (row) in the fields of TensorBoard's raw histogram, packed into
    one f32[L, 5 + 2 * bins] array (one buffer to write per step, not seven); NaN where the
    last update did not compute them. Read it through the properties. The table is a
    `jax.Array`, or a NumPy array once fetched to the host (`as_diagnostics`)."""

    # f32[L, 5 + 2 * bins]: min, max, num, sum, sum_squares, limits, counts
    table: jax.Array | np.ndarray

    @property
    def bins(self) -> int:
        return (self.table.shape[-1] - len(_SCALARS)) // 2

    def _column(self, name: str) -> jax.Array | np.ndarray:
        return self.table[..., _SCALARS.index(name)]

    @property
    def min(self) -> jax.Array | np.ndarray:
        """f32[L]."""
        return self._column("min")

    @property
    def max(self) -> jax.Array | np.ndarray:
        """f32[L]."""
        return self._column("max")

    @property
    def num(self) -> jax.Array | np.ndarray:
        """f32[L]: finite values counted."""
        return self._column("num")

    @property
    def sum(self) -> jax.Array | np.ndarray:
        """f32[L]."""
        return self._column("sum")

    @property
    def sum_squares(self) -> jax.Array | np.ndarray:
        """f32[L]."""
        return self._column("sum_squares")

    @property
    def bucket_limits(self) -> jax.Array | np.ndarray:
        """f32[L, bins]: the buckets' upper edges."""
        return self.table[..., len(_SCALARS) : len(_SCALARS) + self.bins]

    @property
    def bucket_counts(self) -> jax.Array | np.ndarray:
        """f32[L, bins]."""
        return self.table[..., len(_SCALARS) + self.bins :]

    def fields(self) -> dict[str, Any]:
        """Every field by name: the five per-leaf scalars and the two per-leaf rows."""
        out = {name: getattr(self, name) for name in _SCALARS}
        return out | {"bucket_limits": self.bucket_limits, "bucket_counts": self.bucket_counts}


def _table_shape(num_leaves: int, bins: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((num_leaves, len(_SCALARS) + 2 * bins), jnp.float32)


def leaf_norms(tree: Any) -> jax.Array:
    """f32[L]: the L2 norm of every leaf of `tree` (`None` leaves are not leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    return jnp.stack([jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in leaves])


def leaf_histograms(
    tree: Any, bins: int = HISTOGRAM_BINS, shard_axes: Sequence[str] | None = None
) -> Histograms:
    """`xshard.stats.tree.histogram` of every leaf of `tree`, stacked into rows.

    Args:
      tree: the arrays.
      bins: buckets of every histogram.
      shard_axes: inside ``shard_map``, manual mesh axes over which `tree` is the same on
        every shard (a reduced gradient): each shard reads its part of every leaf
        (`xshard.stats.tree.split_over_shards`), and two small collectives (the ranges, then the
        sums) combine the parts. None: every shard computes every histogram whole.
    """
    leaves = [x.astype(jnp.float32).reshape(-1) for x in jax.tree.leaves(tree)]
    if not leaves:
        return Histograms(nan_like(_table_shape(0, bins)))
    if not shard_axes:
        ranges = [histogram_buckets(*finite_range(v)) for v in leaves]
        sums = [histogram_sums(v, lo, hi, bins) for v, (lo, hi) in zip(leaves, ranges)]
    else:
        axes = tuple(shard_axes)
        parts, weights = split_over_shards(leaves, axes)
        local = jnp.stack([jnp.stack(finite_range(p)) for p in parts]) * jnp.array([-1.0, 1.0])
        neg_lo, hi = jax.lax.pmax(local, axes).T
        ranges = [histogram_buckets(-a, b) for a, b in zip(neg_lo, hi)]
        sums = jax.lax.psum(
            jnp.stack(
                [
                    histogram_sums(p, lo, hi, bins, w)
                    for p, (lo, hi), w in zip(parts, ranges, weights)
                ]
            ),
            axes,
        )
    rows = []
    for (lo, hi), row in zip(ranges, sums):
        scalars = jnp.stack([lo, hi, row[0], row[1], row[2]])
        rows.append(jnp.concatenate([scalars, bucket_limits(lo, hi, bins), row[3:]]))
    return Histograms(jnp.stack(rows))


def empty_histograms(tree: Any, bins: int = HISTOGRAM_BINS) -> Histograms:
    """NaN `Histograms` for a gradient shaped like `tree`."""
    return Histograms(nan_like(_table_shape(len(jax.tree.leaves(tree)), bins)))


def summarize_histograms(bins: int = HISTOGRAM_BINS) -> optax.GradientTransformationExtraArgs:
    """Records the `Histograms` of the updates' leaves in its state; the updates pass unchanged.

    The extra update argument ``histograms`` (None, a Python bool or a traced bool) says on
    which updates to compute them (None or False: never; NaN then).
    """

    def init_fn(params):
        return empty_histograms(params, bins)

    def update_fn(updates, state, params=None, *, histograms=None, **extra):
        del params, extra
        flag = False if histograms is None else histograms
        return updates, when(flag, lambda: leaf_histograms(updates, bins))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def leaf_names(tree: Any) -> list[str]:
    """'a/0/b' names of the leaves of `tree`, in the order of the stacked rows."""
    return [path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def as_diagnostics(
    names: list[str],
    grad_norms: np.ndarray,
    param_norms: np.ndarray,
    histograms: Histograms | None = None,
) -> dict[str, Any]:
    """The host-side dict `Hook.on_diagnostics` receives, from fetched (NumPy) arrays.

    Args:
      names: the leaf names (`leaf_names` of the params).
      grad_norms: the gradient's per-leaf norms.
      param_norms: the params' per-leaf norms.
      histograms: the gradient's `Histograms`, or None.

    Returns:
      ``{"grad_norms": {name: float}, "param_norms": {name: float}}`` and, with histograms,
      ``"grad_hist": {name: {min, max, num, sum, sum_squares, bucket_limits, bucket_counts}}``.
    """
    out: dict[str, Any] = {
        "grad_norms": dict(zip(names, np.asarray(grad_norms).tolist(), strict=True)),
        "param_norms": dict(zip(names, np.asarray(param_norms).tolist(), strict=True)),
    }
    if histograms is not None:
        fields = Histograms(np.asarray(histograms.table)).fields()
        out["grad_hist"] = {
            name: {f: v[i] for f, v in fields.items()} for i, name in enumerate(names)
        }
    return out
