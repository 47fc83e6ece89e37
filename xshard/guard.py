"""The two transforms after the reduction: a summary of the reduced gradient and the
non-finite guard.

* `summarize_updates` records the norm, max |g|, non-finite count and per-leaf norms of the
  updates passing through (`xshard.stats.GradSummary`), so the trainer logs them without a second pass.
* `skip_if_nonfinite` applies the inner optimizer only when the updates are finite, like
  `optax.apply_if_finite` (same state field names), but never gives up: the trainer decides
  how many skipped steps in a row are too many. After the reduction the updates are identical
  on every shard, so every shard takes the same decision.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xshard.stats import (
    Flag,
    GradSummary,
    count_nonfinite,
    guard_summary,
    summarize,
    tree_norm,
    when,
)


def empty_summary(params: Any = ()) -> GradSummary:
    """A `GradSummary` of zeros for a gradient shaped like `params` (distinct buffers: a
    donated state must not alias one twice)."""
    return GradSummary(
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.int32),
        jnp.zeros((len(jax.tree.leaves(params)),), jnp.float32),
    )


def summarize_updates() -> optax.GradientTransformationExtraArgs:
    """Records a `GradSummary` of the updates in its state; the updates pass unchanged.

    The extra update argument ``with_stats`` (a bool, may be traced) limits the work: when
    false only max |g| and the non-finite count are computed (the norms are NaN), saving a
    reduction per leaf on steps that log nothing, in the same compiled program.
    """

    def init_fn(params):
        return empty_summary(params)

    def update_fn(updates, state, params=None, *, with_stats=None, **extra_args):
        del state, params, extra_args
        return updates, when(with_stats, lambda: summarize(updates), lambda: guard_summary(updates))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SkipIfNonFiniteState(NamedTuple):
    """State of `skip_if_nonfinite` (field names as `optax.ApplyIfFiniteState`)."""

    notfinite_count: jax.Array  # int32: skipped updates in a row, reset by a finite one
    last_finite: jax.Array  # bool: whether the last update was finite
    total_notfinite: jax.Array  # int32: skipped updates in total
    inner_state: optax.OptState


def skip_if_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Applies `inner` only to finite updates; otherwise zero updates and `inner`'s state kept.

    Args:
      inner: the optimizer to guard (extra arguments are forwarded to it).

    Returns:
      A transformation whose `update` accepts the extra argument ``nonfinite``: the number of
      non-finite elements of the updates when the caller already counted them (e.g.
      `summarize_updates`); otherwise they are counted here.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipIfNonFiniteState(
            jnp.zeros((), jnp.int32),
            jnp.ones((), jnp.bool_),
            jnp.zeros((), jnp.int32),
            inner.init(params),
        )

    def update_fn(updates, state, params=None, *, nonfinite=None, **extra_args):
        finite = (count_nonfinite(updates) if nonfinite is None else nonfinite) == 0

        def apply_inner(inner_state):
            return inner.update(updates, inner_state, params, **extra_args)

        def skip(inner_state):
            shapes = jax.eval_shape(apply_inner, inner_state)[0]
            return jax.tree.map(_zeros_like_abstract, shapes), inner_state

        # A cond, not a select: XLA then updates the donated inner state in place.
        new_updates, new_inner = jax.lax.cond(finite, apply_inner, skip, state.inner_state)
        return new_updates, _counted(state, finite, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _counted(
    state: SkipIfNonFiniteState, finite: jax.Array, new_inner: optax.OptState
) -> SkipIfNonFiniteState:
    """The guard's next state: the skip counters after an update that was (not) `finite`."""
    bad = jnp.where(finite, 0, 1).astype(jnp.int32)
    return SkipIfNonFiniteState(
        jnp.where(finite, 0, state.notfinite_count + 1).astype(jnp.int32),
        finite,
        state.total_notfinite + bad,
        new_inner,
    )


def guarded_apply(inner: optax.GradientTransformation, *, skip_nonfinite: bool):
    """`skip_if_nonfinite` (or `apply_always`) and `optax.apply_updates` as one step.

    The guard's cond is a fusion barrier for XLA: with the updates leaving it, their addition
    to the params is a kernel (and a pass over the params) of its own per leaf. Here the
    addition happens in the branch that computes the updates, so XLA fuses it with the inner
    optimizer's update, as in a step without a guard; the skip branch returns the params
    unchanged. The values are those of the guard's update followed by `optax.apply_updates`.

    Args:
      inner: the optimizer (extra arguments are forwarded to it).
      skip_nonfinite: skip non-finite updates (`skip_if_nonfinite`), else always apply.

    Returns:
      ``apply(updates, state, params, *, nonfinite=None, update_norm=False, **extra) ->
      (new_params, new_state, update_norm)`` for a `SkipIfNonFiniteState` `state`; the
      update's global norm is computed where `update_norm` (a `when` flag) holds (0 for a
      skipped update), NaN elsewhere.
    """
    inner = optax.with_extra_args_support(inner)

    def apply(updates, state, params, *, nonfinite=None, update_norm: Flag = False, **extra):
        def step(inner_state):
            new_updates, new_inner = inner.update(updates, inner_state, params, **extra)
            norm = when(update_norm, lambda: tree_norm(new_updates))
            return optax.apply_updates(params, new_updates), new_inner, norm

        if not skip_nonfinite:
            new_params, new_inner, norm = step(state.inner_state)
            return new_params, state._replace(inner_state=new_inner), norm
        finite = (count_nonfinite(updates) if nonfinite is None else nonfinite) == 0

        def skip(inner_state):
            norm = jax.eval_shape(step, inner_state)[2]
            return params, inner_state, _zeros_like_abstract(norm)

        new_params, new_inner, norm = jax.lax.cond(finite, step, skip, state.inner_state)
        return new_params, _counted(state, finite, new_inner), norm

    return apply


def _zeros_like_abstract(aval: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of `aval`'s shape and dtype, varying over the same manual axes (in shard_map)."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    mat = getattr(aval, "manual_axis_type", None)
    varying = tuple(sorted(getattr(mat, "varying", ()) or ()))
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


def apply_always(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`skip_if_nonfinite`'s state layout without the guard: `inner` applies to every update.

    Lets `cross_shard` keep one state structure whether or not it skips non-finite steps.
    """
    guarded = skip_if_nonfinite(inner)
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, *, nonfinite=None, **extra_args):
        del nonfinite
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
        return new_updates, state._replace(inner_state=new_inner)

    return optax.GradientTransformationExtraArgs(guarded.init, update_fn)
