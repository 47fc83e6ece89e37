"""Per-shard gradients whose weight-gradient matmuls XLA:CPU compiles like GSPMD's.

JAX differentiates ``y = x @ w`` into ``dw = transpose(dot(dy, x))``. Under plain ``jit`` on
several devices the SPMD partitioner puts the gradient's all-reduce between that dot and the
transpose. Inside ``jax.shard_map`` (and on one device) nothing separates them, and XLA's
algebraic simplifier folds the transpose into the dot by swapping its operands. The result
is a dot whose operands are both contracted on their leading dimension. XLA:CPU's YNNPACK
matmul fusions take only canonical dots, so these weight gradients run as plain, slower dots:
14 of tiny_gpt's 16 matmuls in the backward pass.

Evaluating the gradient under ``jax.vmap`` over a leading axis of size one, added to the
batch, gives XLA dots with a unit batch dimension instead. XLA drops that dimension after the
simplifier has run, and every matmul becomes a YNNPACK fusion. Nothing about the values
changes: the function sees a batch of one batch, and the outputs lose the axis again.

`unit_batch` applies this only on backends in `TRANSPOSE_FOLDING_BACKENDS` (XLA:CPU): GPU
and TPU dot emitters take transposed operands natively.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

#: Backends whose matmul kernels need canonical dots, which the transpose fold breaks.
TRANSPOSE_FOLDING_BACKENDS = frozenset({"cpu"})


def unit_batch_by_default() -> bool:
    """Whether `unit_batch` wraps by default: on a backend in `TRANSPOSE_FOLDING_BACKENDS`
    (the default backend's platform)."""
    return jax.default_backend() in TRANSPOSE_FOLDING_BACKENDS


def unit_batch(
    fn: Callable[..., Any], batched_argnums: Sequence[int], *, enabled: bool | None = None
) -> Callable[..., Any]:
    """`fn` evaluated under `jax.vmap` over a unit leading axis of the `batched_argnums`.

    Args:
      fn: typically ``jax.value_and_grad(loss)``; every output must be an array (pytree).
      batched_argnums: the positional arguments (pytrees of arrays) that get the unit axis;
        the others are passed unbatched.
      enabled: wrap (True) or return `fn` unchanged (False); None: `unit_batch_by_default`.

    Returns:
      A function with `fn`'s signature and outputs.
    """
    if not (unit_batch_by_default() if enabled is None else enabled):
        return fn
    batched = frozenset(batched_argnums)

    @functools.wraps(fn)
    def wrapped(*args):
        in_axes = tuple(0 if i in batched else None for i in range(len(args)))
        args = tuple(
            jax.tree.map(lambda x: x[None], a) if i in batched else a for i, a in enumerate(args)
        )
        out = jax.vmap(fn, in_axes=in_axes)(*args)
        return jax.tree.map(lambda x: x[0], out)

    return wrapped
