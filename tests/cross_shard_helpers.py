"""Helpers for the cross_shard tests: a small regression problem and shard_map steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import xshard

N = 8


def make_mesh(shape=(N,), names=("data",)):
    size = int(np.prod(shape))
    devices = np.array(jax.devices()[:size]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def mse(params, batch):
    pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
    return jnp.mean((pred - batch["y"]) ** 2)


def make_problem(batch_size=32, seed=0):
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    params = {"w": 0.1 * jax.random.normal(kw, (4, 3)), "b": jnp.zeros(3)}
    batch = {
        "x": jax.random.normal(kx, (batch_size, 4)),
        "y": jax.random.normal(ky, (batch_size, 3)),
    }
    return params, batch


def sharded_step(tx, mesh, axes=("data",), loss_fn=mse, batch_spec=None):
    """A jitted shard_map step with per-shard gradients, returning (params, state, grads)."""

    def step(params, state, batch):
        local = jax.lax.pcast(params, axes, to="varying")
        grads = jax.grad(loss_fn)(local, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    batch_spec = P("data") if batch_spec is None else batch_spec
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), batch_spec), out_specs=(P(), P()))
    )


def reduced_grads(reduction, grads_fn, mesh, axes=("data",), **kwargs):
    """Runs `grads_fn(shard_index)` on every shard and returns what cross_shard hands inner."""
    tx = xshard.cross_shard(optax.sgd(1.0), reduction, axis_name=axes, **kwargs)

    def body(_):
        idx = jax.lax.axis_index(axes)
        grads = grads_fn(idx)
        updates, _ = tx.update(grads, tx.init(jax.tree.map(jnp.zeros_like, grads)))
        return jax.tree.map(lambda u: -u, updates)  # sgd(1): update = -grad

    spec = P(axes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=P()))(
        jnp.zeros(mesh.size)
    )


def assert_trees_close(a, b, **tol):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **tol), a, b)


SLICE_AXES = ("slice", "data")


def make_slice_mesh():
    """The (2, 4) mesh ('slice', 'data') of `mesh=cpu2x4_slices`, as jax.make_mesh builds it."""
    return jax.make_mesh((2, 4), SLICE_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def per_replica(fn, *xs, mesh=None):
    """``fn(*rows)`` on every device of the (slice, data) mesh, row ``i`` of each of `xs` (a
    leading dimension of 8) on device ``i``; every output stacked back to a leading 8."""
    mesh = make_slice_mesh() if mesh is None else mesh
    spec = P(SLICE_AXES)

    def body(*blocks):
        out = fn(*(jax.tree.map(lambda b: b[0], x) for x in blocks))
        return jax.tree.map(lambda o: jnp.asarray(o)[None], out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(*xs)


def assert_same_on_every_replica(stacked):
    """Every row of every leaf (a leading replica dimension) bitwise equal to row 0."""
    for leaf in jax.tree.leaves(stacked):
        leaf = np.asarray(leaf)
        for row in leaf[1:]:
            np.testing.assert_array_equal(row, leaf[0])
