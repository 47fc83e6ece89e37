"""Rematerialisation of a task's layers: ``trainer.remat`` by name, as JAX checkpoint policies.

A task opts in by taking a ``remat`` argument (its YAML node says ``remat: ${trainer.remat}``)
and wrapping each layer's function once, when it builds its forward pass::

    from trainers.tasks.remat import remat

    layer = remat(my_layer, self.remat)      # my_layer(params, x) -> x
    for p in params["layers"]:
        x = layer(p, x)

The names (`trainers.config.precision.REMAT_POLICIES`): ``none`` returns the function as it is;
``full`` is ``jax.checkpoint`` without a policy (only the layer's inputs are kept); every other
name is the ``jax.checkpoint_policies`` policy of that name. Flax models use the same policies
with ``nnx.remat`` / ``nn.remat`` (`checkpoint_policy`).

On XLA:CPU a policy changes nothing by default: the CPU compiler expands the optimization
barriers ``jax.checkpoint`` lowers to (its ``cse_barrier_expander`` pass) before it eliminates
common subexpressions, which merges the recomputed forward pass back into the saved one (remat
is meant for GPUs and TPUs, where it is how JAX saves activation memory). `XLA_CPU_KEEP_REMAT`
(``Lowered.compile(compiler_options=...)``; for a whole run,
``XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander``) keeps them on CPU too: the
benchmark and the tests measure remat's memory with it (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from trainers.config.precision import NO_REMAT, check_remat

F = TypeVar("F", bound=Callable[..., Any])

#: The XLA:CPU pass that expands ``jax.checkpoint``'s barriers before CSE (module docstring).
XLA_CPU_BARRIER_PASS = "cse_barrier_expander"
#: XLA:CPU compiler options that keep ``jax.checkpoint``'s barriers, so remat recomputes
#: (module docstring); for ``jax.stages.Lowered.compile(compiler_options=...)``.
XLA_CPU_KEEP_REMAT = {"xla_disable_hlo_passes": XLA_CPU_BARRIER_PASS}


def remat_undone_here() -> bool:
    """Whether this process compiles for XLA:CPU with `XLA_CPU_BARRIER_PASS` on (``XLA_FLAGS``
    does not disable it): a remat policy then saves no memory."""
    flags = os.environ.get("XLA_FLAGS", "")
    return jax.default_backend() == "cpu" and XLA_CPU_BARRIER_PASS not in flags


def checkpoint_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy named `name` (None for ``full``: save nothing).

    Raises:
      ConfigError: for a name not in `REMAT_POLICIES`, or ``none`` (no checkpoint at all).
    """
    check_remat(name)
    if name == NO_REMAT:
        raise ValueError("trainer.remat=none applies no checkpoint: there is no policy.")
    return None if name == "full" else getattr(jax.checkpoint_policies, name)


def remat(fn: F, name: str, *, static_argnums: tuple[int, ...] = ()) -> F:
    """`fn` rematerialised with the policy `name` (`fn` itself for ``none``).

    Args:
      fn: a layer's function of arrays (and pytrees of them).
      name: ``trainer.remat``.
      static_argnums: positions of `fn`'s arguments that are not arrays.
    """
    if check_remat(name) == NO_REMAT:
        return fn
    policy = checkpoint_policy(name)
    return jax.checkpoint(fn, policy=policy, static_argnums=static_argnums)  # type: ignore[return-value]
