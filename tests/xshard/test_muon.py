"""xshard.optim.muon: optax.contrib.muon's arithmetic and state, bit for bit, with each matrix
orthogonalised whole under a sharded state (the collectives: tests/trainers/core/test_zero.py),
or by one device under a replicated one (``muon_spread``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xshard.optim.muon import muon, scale_by_muon, whole_updates
from xshard.optim.muon_masks import hidden_matrices
from xshard.optim.muon_owners import swap_order, swap_state

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


@pytest.mark.parametrize(("shard", "dots", "gathers"), [(True, 30, 2), (False, 45, 0)])
def test_spread_orthogonalises_each_matrix_on_one_device_as_optax_does(shard, dots, gathers):
    # Stage 0's Muon (trainers.core.step.zero_update.owner_args): the replicated momentum's
    # matrices split over the 8 devices, by shape ((16, 8) transposed to (8, 16); the two
    # (8, 24)-shaped), each padded to 8; each device runs the iterations of its own (15 dots
    # per group, not per matrix) and one all-gather per group brings the updates back. Under
    # GSPMD (here) in a shard_map of its own; grad_impl=manual runs the same inside its step's
    # (tests/trainers/core/test_zero_matrix_opts.py trains both paths against stage 3).
    # shard_orthogonalization=False: every device orthogonalises every matrix (15 dots per
    # matrix) and nothing is gathered.
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
    matrices = [x for x in jax.tree.leaves(PARAMS) if x.ndim == 2]
    dims = [optax.contrib.MuonDimensionNumbers()] * len(matrices)
    ours = scale_by_muon(weight_dimension_numbers=dims, shard_orthogonalization=shard)
    theirs = optax.contrib.scale_by_muon(weight_dimension_numbers=dims)
    grads = [jnp.sin(x) + 0.1 for x in matrices]
    update = lambda g, s: ours.update(g, s, muon_spread=("data",))
    with jax.set_mesh(mesh):
        compiled = jax.jit(update).lower(grads, ours.init(matrices)).compile()
        got = compiled(grads, ours.init(matrices))
    want = theirs.update(grads, theirs.init(matrices))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)  # batched products: float32 rounding
    ops = re.findall(r"\s(dot|all-gather)(?:-start)?\(", compiled.as_text())
    assert ops.count("dot") == dots  # 2 groups (or 3 matrices), 5 iterations of 3 products
    assert ops.count("all-gather") == gathers


def test_owned_keeps_the_momentum_in_owner_order_and_updates_as_optax_does():
    # Stage 3's Muon (trainers.core.step.zero_update.owner_args): eight (16, 8) matrices, rows
    # sliced over 8 devices, the momentum in owner order (each device holds one matrix whole).
    # A gradient in owner order (the manual step's) costs one all-to-all, the update's way back
    # to the rows; one in row order one more, to the owners.
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("data"))
    matrices = [jnp.linspace(-1.0, 1.0 + k, 16 * 8).reshape(16, 8) for k in range(8)]
    dims = [optax.contrib.MuonDimensionNumbers()] * 8
    ours = scale_by_muon(weight_dimension_numbers=dims)
    theirs = optax.contrib.scale_by_muon(weight_dimension_numbers=dims)
    groups = [list(range(8))]
    for owned_grads in (False, True):
        state, want_state = ours.init(matrices), theirs.init(matrices)
        update = jax.jit(
            lambda g, s, o=owned_grads: ours.update(g, s, muon_owners=8, muon_owned_grads=o),
            out_shardings=([rows] * 8, None),
        )
        for scale in (1.0, 2.0):
            grads = [jnp.sin(x * scale) for x in matrices]
            want, want_state = theirs.update(grads, want_state)
            sent = swap_order(grads, groups) if owned_grads else grads
            with jax.set_mesh(mesh):
                sent = jax.device_put(sent, rows)
                compiled = update.lower(sent, state).compile()
                got, state = compiled(sent, state)
            for a, b in zip(want, got, strict=True):
                np.testing.assert_allclose(b, a, atol=3e-5)  # batched products: float32
        row_order = swap_state(state, 8)
        for a, b in zip(want_state.mu, row_order.mu, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-6)
        ops = re.findall(r"\s(all-to-all|all-gather|all-reduce)(?:-start)?\(", compiled.as_text())
        assert ops == ["all-to-all"] * (1 if owned_grads else 2)
