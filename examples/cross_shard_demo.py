"""Runnable example: a cross-shard optimizer on 8 simulated CPU devices.

    python examples/cross_shard_demo.py

Each of the 8 shards computes the gradient of its own slice of the batch (per-shard, as TF's
`compute_gradients` did); `xshard.cross_shard` averages them before Adam updates the params.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import xshard


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tx = xshard.cross_shard(optax.adam(1e-1), reduction="mean", axis_name="data")

    def loss_fn(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def step(w, opt_state, x, y):
        # Per-shard gradient: make the replicated params varying over `data` first.
        w_local = jax.lax.pcast(w, "data", to="varying")
        loss, g = jax.value_and_grad(loss_fn)(w_local, x, y)
        updates, opt_state = tx.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, jax.lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P())
        ),
        donate_argnums=(0, 1),
    )
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 4))
    y = x @ jax.random.normal(kw, (4,))
    w = jnp.zeros(4)
    opt_state = tx.init(w)
    for i in range(100):
        w, opt_state, loss = step(w, opt_state, x, y)
        if i % 20 == 0 or i == 99:
            print(f"step {i:3d}  loss {float(loss):.5f}")  # blocks: bounds in-flight steps
    print("slots:", xshard.get_slot_names(opt_state))


if __name__ == "__main__":
    main()
