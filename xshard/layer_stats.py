"""Per-parameter statistics of a gradient, stacked into a few arrays, and the transform that
records them in an optimizer state.

`cross_shard` records them for the reduced gradient (the one the inner optimizer applies) on
the steps that ask for them (extra update arguments ``layer_stats`` and ``histograms``), so a
trainer logs per-layer norms and histograms of the applied gradient without a second forward
and backward pass. The arrays are stacked over the leaves, in `jax.tree.leaves` order, so the
state holds a handful of small arrays whatever the model (and `optax.tree_map_params` never
mistakes them for per-parameter state).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xshard.stats import histogram, nan_like, path_str, when

#: Buckets of every gradient histogram.
HISTOGRAM_BINS = 64


class Histograms(NamedTuple):
    """One histogram per leaf (row), in the fields of TensorBoard's raw histogram."""

    min: jax.Array  # f32[L]
    max: jax.Array  # f32[L]
    num: jax.Array  # f32[L]: finite values counted
    sum: jax.Array  # f32[L]
    sum_squares: jax.Array  # f32[L]
    bucket_limits: jax.Array  # f32[L, bins]: upper edges
    bucket_counts: jax.Array  # f32[L, bins]


class LayerSummary(NamedTuple):
    """Per-leaf statistics of a gradient; NaN where the last update did not compute them."""

    norms: jax.Array  # f32[L]: L2 norm of every leaf
    hist: Histograms


def _shapes(num_leaves: int, bins: int) -> LayerSummary:
    vec = jax.ShapeDtypeStruct((num_leaves,), jnp.float32)
    mat = jax.ShapeDtypeStruct((num_leaves, bins), jnp.float32)
    return LayerSummary(vec, Histograms(vec, vec, vec, vec, vec, mat, mat))


def leaf_norms(tree: Any) -> jax.Array:
    """f32[L]: the L2 norm of every leaf of `tree` (`None` leaves are not leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    return jnp.stack([jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in leaves])


def leaf_histograms(tree: Any, bins: int = HISTOGRAM_BINS) -> Histograms:
    """`xshard.stats.histogram` of every leaf of `tree`, stacked into rows."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return nan_like(_shapes(0, bins).hist)
    rows = [histogram(x, bins) for x in leaves]
    return Histograms(**{f: jnp.stack([r[f] for r in rows]) for f in Histograms._fields})


def empty_layer_summary(tree: Any, bins: int = HISTOGRAM_BINS) -> LayerSummary:
    """A NaN `LayerSummary` for a gradient shaped like `tree`."""
    return nan_like(_shapes(len(jax.tree.leaves(tree)), bins))


def summarize_layers(bins: int = HISTOGRAM_BINS) -> optax.GradientTransformationExtraArgs:
    """Records a `LayerSummary` of the updates in its state; the updates pass unchanged.

    Extra update arguments (each None, a Python bool or a traced bool):
      layer_stats: compute the per-leaf norms (None or False: not computed, NaN).
      histograms: also the per-leaf histograms (only where `layer_stats` holds).
    """

    def init_fn(params):
        return empty_layer_summary(params, bins)

    def update_fn(updates, state, params=None, *, layer_stats=None, histograms=None, **extra):
        del params, extra
        if layer_stats is None or layer_stats is False:
            return updates, nan_like(jax.eval_shape(lambda: state))

        def compute():
            hist = when(
                False if histograms is None else histograms,
                lambda: leaf_histograms(updates, bins),
            )
            return LayerSummary(leaf_norms(updates), hist)

        return updates, when(layer_stats, compute)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def leaf_names(tree: Any) -> list[str]:
    """'a/0/b' names of the leaves of `tree`, in the order of the stacked rows."""
    return [path_str(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def as_diagnostics(
    names: list[str], grads: LayerSummary, param_norms: Any, *, histograms: bool
) -> dict[str, Any]:
    """The host-side dict `Hook.on_diagnostics` receives, from fetched (NumPy) arrays.

    Args:
      names: the leaf names (`leaf_names` of the params).
      grads: the gradient's `LayerSummary`, fetched to the host.
      param_norms: the params' `leaf_norms`, fetched to the host.
      histograms: whether to include the gradient histograms.

    Returns:
      ``{"grad_norms": {name: float}, "param_norms": {name: float}}`` and, with histograms,
      ``"grad_hist": {name: {min, max, num, sum, sum_squares, bucket_limits, bucket_counts}}``.
    """
    out: dict[str, Any] = {
        "grad_norms": dict(zip(names, np.asarray(grads.norms).tolist(), strict=True)),
        "param_norms": dict(zip(names, np.asarray(param_norms).tolist(), strict=True)),
    }
    if histograms:
        fields = {f: np.asarray(v) for f, v in grads.hist._asdict().items()}
        out["grad_hist"] = {
            name: {f: v[i] for f, v in fields.items()} for i, name in enumerate(names)
        }
    return out
