"""Which manual mesh axes a value varies over, in JAX's type of it inside ``jax.shard_map``.

Inside a ``shard_map`` with ``check_vma`` on, JAX types every value with the manual axes it
*varies* over (differs between devices); a collective such as ``lax.psum`` over an axis needs
its operands to be varying over it, and an output with a replicated out spec must be
invariant. These two helpers read and set that type.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset[str]:
    """The manual axes `x` varies over (empty outside a ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", ()))  # older JAX spelling


def as_varying(x: jax.Array, axes: tuple[str, ...] | frozenset[str]) -> jax.Array:
    """`x` typed as varying over every one of `axes` (``lax.pcast`` of those it is not):
    the same values, each device's copy counted as its own."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
