"""xshard.mesh.collectives on 8 simulated devices: packing a tree into one collective per dtype
gives exactly what the per-leaf collectives give, and the compiled program holds one per dtype."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from xshard.mesh.collectives import (
    UNCOMBINED_BACKENDS,
    all_gather_tree,
    packs_by_default,
    psum_scatter_tree,
    psum_tree,
)

AXES = ("data", "fsdp")


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def tree_and_dims():
    """Leaves of two dtypes, sliced along different dims, one left whole, one None."""
    rng = np.random.default_rng(0)

    def arr(shape, dtype=np.float32):
        return jnp.asarray(rng.normal(size=shape).astype(dtype))

    tree = {
        "w": arr((16, 24)),
        "w_t": arr((3, 8, 5)),  # sliced along dim 1
        "b": arr((5,)),  # no dim divides by 8: whole
        "h": arr((8, 4), np.float16),
        "g": arr((2, 16), np.float16),  # sliced along dim 1
        "none": None,
    }
    dims = {"w": 0, "w_t": 1, "b": None, "h": 0, "g": 1, "none": None}
    return tree, dims


def per_shard(tree, shard):
    """A different tree per shard (the shard index scales it), as per-shard gradients are."""
    return jax.tree.map(lambda x: x * (1 + shard).astype(x.dtype), tree)


def spec(dim):
    return P() if dim is None else P(*([None] * dim), AXES)


def run(mesh, body, tree, dims, in_specs, out_specs):
    f = jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs)
    return jax.jit(f)(tree)


def test_psum_scatter_tree_equals_per_leaf_psum_scatter(mesh):
    tree, dims = tree_and_dims()
    out_specs = jax.tree.map(spec, dims, is_leaf=lambda x: x is None)
    idx = lambda: jax.lax.axis_index(AXES)

    def packed(t):
        return psum_scatter_tree(per_shard(t, idx()), dims, AXES)

    def per_leaf(t):
        t = per_shard(t, idx())
        return jax.tree.map(
            lambda d, x: (
                jax.lax.psum(x, AXES)
                if d is None
                else jax.lax.psum_scatter(x, AXES, scatter_dimension=d, tiled=True)
            ),
            dims,
            t,
            is_leaf=lambda x: x is None,
        )

    got = run(mesh, packed, tree, dims, P(), out_specs)
    want = run(mesh, per_leaf, tree, dims, P(), out_specs)
    assert got["none"] is None
    for k in ("w", "w_t", "b", "h", "g"):
        assert got[k].shape == tree[k].shape and got[k].dtype == tree[k].dtype
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
        # and the sum is the sum: 1 + 2 + ... + 8 = 36 times the input
        np.testing.assert_allclose(
            np.asarray(got[k], np.float32), 36 * np.asarray(tree[k], np.float32), rtol=2e-3
        )


def test_all_gather_tree_inverts_the_slicing(mesh):
    tree, dims = tree_and_dims()
    in_specs = jax.tree.map(spec, dims, is_leaf=lambda x: x is None)
    got = run(mesh, lambda t: all_gather_tree(t, dims, AXES), tree, dims, in_specs, P())
    for k in ("w", "w_t", "b", "h", "g"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(tree[k]), err_msg=k)
    assert got["none"] is None


def count(text, op):
    return len(re.findall(rf"\s{op}(?:-start)?\(", text))


def test_one_collective_per_dtype_in_the_compiled_program(mesh):
    tree, dims = tree_and_dims()
    in_specs = jax.tree.map(spec, dims, is_leaf=lambda x: x is None)
    scatter = jax.jit(
        jax.shard_map(
            lambda t: psum_scatter_tree(t, dims, AXES),
            mesh=mesh,
            in_specs=(P(),),
            out_specs=in_specs,
        )
    )
    gather = jax.jit(
        jax.shard_map(
            lambda t: all_gather_tree(t, dims, AXES), mesh=mesh, in_specs=(in_specs,), out_specs=P()
        )
    )
    scattered = scatter.lower(tree).compile().as_text()
    gathered = gather.lower(tree).compile().as_text()
    assert count(scattered, "reduce-scatter") == 2  # float32 and float16
    assert count(gathered, "all-gather") == 2


def test_pack_false_issues_one_collective_per_leaf_with_the_same_values(mesh):
    tree, dims = tree_and_dims()
    out_specs = jax.tree.map(spec, dims, is_leaf=lambda x: x is None)

    def body(pack):
        return jax.jit(
            jax.shard_map(
                lambda t: psum_scatter_tree(
                    per_shard(t, jax.lax.axis_index(AXES)), dims, AXES, pack=pack
                ),
                mesh=mesh,
                in_specs=(P(),),
                out_specs=out_specs,
            )
        )

    per_leaf, packed = body(False), body(True)
    assert count(per_leaf.lower(tree).compile().as_text(), "reduce-scatter") == 4  # w w_t h g
    got, want = per_leaf(tree), packed(tree)
    for k in ("w", "w_t", "b", "h", "g"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.parametrize("pack", [True, False])
def test_psum_tree_equals_per_leaf_psum_and_unpacks_what_its_parts_become(mesh, pack):
    tree, _ = tree_and_dims()
    idx = lambda: jax.lax.axis_index(AXES)

    def body(t):
        packed = psum_tree(per_shard(t, idx()), AXES, pack=pack)
        halves = packed.unpack([p / 2 for p in packed.parts])  # elementwise on the buffers
        return packed.tree, halves, jax.lax.psum(per_shard(t, idx()), AXES)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P()))
    got, halves, want = f(tree)
    assert got["none"] is None and halves["none"] is None
    for k in ("w", "w_t", "b", "h", "g"):
        assert got[k].shape == tree[k].shape and got[k].dtype == tree[k].dtype
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
        np.testing.assert_array_equal(np.asarray(halves[k]), np.asarray(want[k]) / 2, err_msg=k)
    reduced = f.lower(tree).compile().as_text()
    # Packed: one flat buffer per dtype (float32: 384 + 120 + 5, float16: 32 + 32).
    shapes = set(re.findall(r"(f32|f16)\[(\d+)\]", reduced))
    assert (("f32", "509") in shapes and ("f16", "64") in shapes) == pack


def test_psum_tree_packs_matrices_column_by_column(mesh):
    """The order XLA:CPU writes a weight's gradient in (`_column_major`): the buffer holds a
    matrix's columns one after the other, other leaves row by row."""
    tree = {"b": jnp.arange(2.0), "w": jnp.arange(6.0).reshape(2, 3), "t": jnp.ones((1, 2, 2))}
    body = lambda t: psum_tree(t, AXES, pack=True).parts[0] / 8
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),), out_specs=P()))
    want = [0, 1, 1, 1, 1, 1, 0, 3, 1, 4, 2, 5]  # b, t, then w's columns (0 3) (1 4) (2 5)
    np.testing.assert_array_equal(np.asarray(f(tree)), np.asarray(want, np.float32))


def test_packing_by_default_only_where_xla_does_not_combine_collectives():
    assert packs_by_default() == (jax.default_backend() in UNCOMBINED_BACKENDS)
    assert packs_by_default()  # the tests run on the CPU backend, which does not combine
