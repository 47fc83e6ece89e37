"""xshard.optim.packed: leaves held as one vector per dtype, their layout as JAX sees it, and
`tree_map_params` over a state that holds them (issue 38)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xshard
from tests.reliability_helpers import assert_bitwise_equal
from xshard.optim.packed import PackedLeaves, tree_map_params


def host(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def test_packed_leaves_round_trip_dtypes_and_batches():
    tree = {"n": jnp.int32(3), "ok": jnp.bool_(True), "v": jnp.arange(4.0), "m": jnp.ones((2, 3))}
    packed = PackedLeaves.pack(tree)
    assert [v.dtype for v in packed.vectors] == [jnp.float32, jnp.int32]  # bool held as int32
    assert [v.shape for v in packed.vectors] == [(10,), (2,)]  # m, v; n, ok
    assert_bitwise_equal(host(packed.unpack()), host(tree))
    assert packed.unpack()["ok"].dtype == jnp.bool_
    # Stacked (a vmapped state at rest): each leaf keeps the leading dimension.
    stacked = jax.vmap(lambda x: PackedLeaves.pack(jax.tree.map(lambda a: a * x, tree)))(
        jnp.arange(1, 3)
    )
    assert stacked.unpack()["m"].shape == (2, 2, 3)
    assert stacked.unpack()["n"].tolist() == [3, 6]


def test_layouts_differing_only_in_sizes_are_other_structures_and_retrace():
    # Same names, dtypes and ranks, and vectors of one length (5): only the sizes (so the
    # offsets) differ. A program traced for one must not read the other.
    two_three = PackedLeaves.pack({"a": jnp.arange(2.0), "b": jnp.arange(3.0)})
    three_two = PackedLeaves.pack({"a": jnp.arange(3.0), "b": jnp.arange(2.0)})
    assert two_three.vectors[0].shape == three_two.vectors[0].shape
    assert two_three.layout != three_two.layout
    assert jax.tree.structure(two_three) != jax.tree.structure(three_two)
    assert two_three.layout == PackedLeaves.pack({"a": jnp.ones(2), "b": jnp.ones(3)}).layout
    assert hash(two_three.layout) == hash(
        PackedLeaves.pack({"a": jnp.ones(2), "b": jnp.ones(3)}).layout
    )

    traces = []

    @jax.jit
    def sum_of_a(packed):
        traces.append(packed.layout)
        return packed.unpack()["a"].sum()

    assert float(sum_of_a(two_three)) == 1.0
    assert float(sum_of_a(three_two)) == 3.0  # 0 + 1 + 2: its own offsets
    assert float(sum_of_a(two_three)) == 1.0
    assert traces == [two_three.layout, three_two.layout]


@pytest.mark.parametrize("non_params", [None, lambda _: "other"], ids=["kept", "mapped"])
def test_tree_map_params_maps_a_cross_shard_state(non_params):
    # optax's matches the state against one built for placeholder params, whose packed
    # records (sized by the params: per-leaf norms, histograms) have another layout.
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    tx = xshard.cross_shard(optax.adam(1e-3), "mean", axis_name="data", skip_nonfinite=True)
    state = tx.init(params)
    with pytest.raises(ValueError, match="metadata"):
        optax.tree_map_params(tx, lambda p: p, state)

    mapped = tree_map_params(tx, lambda p: "param", state, transform_non_params=non_params)

    assert jax.tree.structure(mapped) == jax.tree.structure(state)  # the layout kept
    adam = xshard.inner_state(mapped)[0]
    assert adam.mu == adam.nu == {"w": "param", "b": "param"}
    expected = state.stats.vectors if non_params is None else ("other", "other")
    assert mapped.stats.vectors == expected


def test_cross_shard_state_builds_and_reads_by_the_names_it_had_unpacked():
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    tx = xshard.cross_shard(optax.adam(1e-3), "mean", axis_name="data", clip_per_shard=1.0)
    state = tx.init(params)
    # The constructor's arguments before the packing, by name (comm left out: no axis rules).
    rebuilt = xshard.CrossShardState.of(
        clip=state.clip,
        shards=state.shards,
        reduced=state.reduced._replace(norm=jnp.float32(2.0)),
        histograms=state.histograms,
        guard=state.guard._replace(total_notfinite=jnp.int32(3)),
    )
    assert jax.tree.structure(rebuilt) == jax.tree.structure(state)
    assert float(rebuilt.reduced.norm) == 2.0 and int(rebuilt.skipped_steps) == 3
    assert int(rebuilt.guard.total_notfinite) == 3 and rebuilt.inner_state is state.inner_state
    assert rebuilt.reduced.leaf_norms.shape == (2,)
    assert_bitwise_equal(host(rebuilt.clip), host(state.clip))  # NaN: not measured yet
