"""xshard.optim.muon: optax.contrib.muon's arithmetic and state, bit for bit, with each matrix
orthogonalised whole under a sharded state (the collectives: tests/trainers/core/test_zero.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from xshard.optim.muon import muon, whole_updates
from xshard.optim.muon_masks import hidden_matrices

PARAMS = {
    "embed": jnp.linspace(-1.0, 1.0, 16 * 8).reshape(16, 8),
    "layers": [
        {"w": jnp.linspace(-0.5, 0.7, 8 * 24).reshape(8, 24), "b": jnp.zeros(24)},
        {"w": jnp.linspace(0.3, -0.2, 24 * 8).reshape(24, 8), "b": jnp.ones(8)},
    ],
}


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # optax's default rule: every 2-D parameter
        {  # every other branch: the named rule, the RMS scaling, plain momentum, ...
            "muon_weight_dimension_numbers": hidden_matrices,
            "consistent_rms": 0.2,
            "nesterov": False,
            "adaptive": True,
            "weight_decay": 0.1,
            "ns_coeffs": "dion",
        },
    ],
)
def test_muon_is_optax_contrib_muon_bit_for_bit(kwargs):
    ours, theirs = muon(1e-2, **kwargs), optax.contrib.muon(1e-2, **kwargs)
    s_ours, s_theirs = ours.init(PARAMS), theirs.init(PARAMS)
    update_ours, update_theirs = jax.jit(ours.update), jax.jit(theirs.update)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)  # checkpoints carry over
    for scale in (1.0, 2.0):
        grads = jax.tree.map(lambda p, s=scale: jnp.sin(p * s) + 0.1, PARAMS)
        u_ours, s_ours = update_ours(grads, s_ours, PARAMS)
        u_theirs, s_theirs = update_theirs(grads, s_theirs, PARAMS)
        for a, b in zip(jax.tree.leaves((u_theirs, s_theirs)), jax.tree.leaves((u_ours, s_ours))):
            np.testing.assert_array_equal(b, a)


def test_whole_updates_names_the_parameters_muon_orthogonalises():
    # The ZeRO step leaves these out of the params' gather: their update is whole.
    expected = jax.tree.map(lambda d: d is not None, hidden_matrices(PARAMS), is_leaf=_is_dims)
    state = muon(1e-2, muon_weight_dimension_numbers=hidden_matrices).init(PARAMS)
    assert whole_updates(state) == expected
    assert whole_updates(muon(1e-2).init(PARAMS)) == jax.tree.map(lambda x: x.ndim == 2, PARAMS)
    assert whole_updates(optax.adamw(1e-2).init(PARAMS)) is None


def _is_dims(x):
    return x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
