"""Streaming DiLoCo's delay and mixing (``sync_delay`` tau, ``mix`` alpha) in the real Trainer
on 8 simulated CPU devices (2 replicas over ``slice`` x 4 devices over ``data``), against a
reference of the equations written here in NumPy and plain JAX, not with the trainer's code:

  at a fragment's sync step t each replica sends ``outer - replica(t)`` (+ its error-feedback
  residual); after step t + tau the mean over replicas feeds the outer optimizer, giving O';
  each replica sets the fragment to ``alpha * replica(t + tau) + (1 - alpha) * O'``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.trainers.core.test_periodic import BATCH, make, outer_tree, run
from trainers.tasks.mlp import MLPTask
from xshard.config.axes import AxisRule

REPLICAS, DEVICES = 2, 4  # the mesh: slice x data
EVERY, STEPS, BLOCK = 4, 11, 256
OUTER = dict(learning_rate=0.7, momentum=0.9, nesterov=True)
INNER = optax.sgd(0.05, momentum=0.9)


@pytest.fixture(scope="module")
def task():
    return MLPTask(hidden=(32,), activation="tanh")


@pytest.fixture(scope="module")
def mesh():
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[:8]).reshape(REPLICAS, DEVICES)
    return Mesh(devices, ("slice", "data"), axis_types=(AxisType.Auto,) * 2)


# ----------------------------------------------------------------------------- the reference


def _loss(params, x, y):
    layers = params["layers"]
    h = x
    for i, layer in enumerate(layers):
        h = h @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            h = jnp.tanh(h)
    return jnp.mean(jnp.square(h - y))


@jax.jit
def _replica_grad(params, x, y):
    """A replica's gradient: the mean of its devices' gradients, each on its rows."""
    shard = lambda a: a.reshape(DEVICES, -1, *a.shape[1:])
    grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0, 0))(params, shard(x), shard(y))
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)


def _int8(blocks, scales):
    return np.clip(np.round(blocks / scales[:, None]), -127, 127) * scales[:, None]


def _scales(absmax):
    """The smallest power of two s with absmax <= 127 s (1 for a zero block)."""
    s = np.exp2(np.ceil(np.log2(np.maximum(absmax, 1e-30) / 127))).astype(np.float32)
    s = np.where(absmax > 127 * s, 2 * s, s)
    s = np.where(absmax <= 127 * s / 2, s / 2, s)
    return np.where(absmax > 0, s, np.float32(1)).astype(np.float32)


def _mean_int8(messages):
    """Mean over replicas of one device's share, through int8 both ways: the replicas' shares
    with shared scales, their mean re-encoded with its own. Returns (mean, new residuals)."""
    blocks = [m.reshape(-1, BLOCK) for m in messages]
    scales = _scales(np.max([np.abs(b).max(axis=1) for b in blocks], axis=0))
    sent = [_int8(b, scales) for b in blocks]
    mean = (sent[0] + sent[1]) / np.float32(REPLICAS)
    back = _int8(mean, _scales(np.abs(mean).max(axis=1)))
    return back.reshape(-1), [(b - q).reshape(-1) for b, q in zip(blocks, sent, strict=True)]


def _share(size):
    """One device's share of a fragment of `size` elements: whole blocks for each replica."""
    unit, share = REPLICAS * BLOCK, -(-size // DEVICES)
    return max(1, -(-share // unit)) * unit


def _reduce(deltas, residuals, codec):
    """The mean over replicas of `deltas` (one flat float32 vector each)."""
    if codec is None:
        return (deltas[0] + deltas[1]) / np.float32(REPLICAS), residuals
    share = _share(deltas[0].size)
    padded = [np.pad(d, (0, DEVICES * share - d.size)) + r for d, r in zip(deltas, residuals)]
    out, new = [], [np.zeros_like(r) for r in residuals]
    for i in range(DEVICES):
        part = slice(i * share, (i + 1) * share)
        mean, res = _mean_int8([p[part] for p in padded])
        out.append(mean)
        for r, x in zip(new, res, strict=True):
            r[part] = x
    return np.concatenate(out)[: deltas[0].size], new


def reference(params, batches, groups, tau, alpha, codec):
    """The outer params and both replicas' params after `STEPS` steps."""
    leaves, treedef = jax.tree.flatten(jax.tree.map(np.asarray, params))
    replicas = [list(leaves) for _ in range(REPLICAS)]
    inner = [INNER.init(treedef.unflatten(leaves)) for _ in range(REPLICAS)]
    outer_tx = optax.sgd(**OUTER)
    outer = [[leaves[i] for i in g] for g in groups]
    outer_opt = [outer_tx.init(o) for o in outer]
    size = lambda g: sum(leaves[i].size for i in g)
    residual = [[np.zeros(DEVICES * _share(size(g)), np.float32)] * REPLICAS for g in groups]
    pending = [None] * len(groups)
    due = lambda t: [f for f in range(len(groups)) if t > 0 and t % EVERY == _offset(f, groups)]
    for t, batch in zip(range(1, STEPS + 1), batches, strict=False):
        for r in range(REPLICAS):
            rows = slice(r * BATCH // REPLICAS, (r + 1) * BATCH // REPLICAS)
            grads = _replica_grad(
                treedef.unflatten(replicas[r]), batch["x"][rows], batch["y"][rows]
            )
            updates, inner[r] = INNER.update(grads, inner[r], treedef.unflatten(replicas[r]))
            new = optax.apply_updates(treedef.unflatten(replicas[r]), updates)
            replicas[r] = [np.asarray(x) for x in jax.tree.leaves(new)]
        for f in due(t):  # send: outer - replica(t)
            pending[f] = [
                np.concatenate([(o - rep[i]).ravel() for o, i in zip(outer[f], groups[f])])
                for rep in replicas
            ]
        for f in due(t - tau):  # after t + tau: the outer update, then the mixing
            mean, residual[f] = _reduce(pending[f], residual[f], codec)
            cut = np.cumsum([leaves[i].size for i in groups[f]])[:-1]
            mean = [m.reshape(leaves[i].shape) for m, i in zip(np.split(mean, cut), groups[f])]
            updates, outer_opt[f] = outer_tx.update(mean, outer_opt[f], outer[f])
            outer[f] = [np.asarray(x) for x in optax.apply_updates(outer[f], updates)]
            for rep in replicas:
                for o, i in zip(outer[f], groups[f], strict=True):
                    rep[i] = o if alpha == 0 else alpha * rep[i] + (1 - alpha) * o
    flat = [None] * len(leaves)
    for o, g in zip(outer, groups, strict=True):
        for x, i in zip(o, g, strict=True):
            flat[i] = x
    return flat, replicas


def _offset(f, groups):
    return ((f + 1) * EVERY // len(groups)) % EVERY


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(
    "tau, alpha, fragments, codec",
    [
        (0, 0.0, 1, None),  # DiLoCo
        (3, 0.5, 2, None),
        (1, 0.25, 2, "int8"),
        (2, 1.0, 1, "int8"),
    ],
)
def test_delay_and_mixing_match_the_reference(task, mesh, tau, alpha, fragments, codec):
    rule = AxisRule(
        every_steps=EVERY,
        outer_optimizer=optax.sgd(**OUTER),
        fragments=fragments,
        comm_dtype=codec,
        error_feedback=codec is not None,
        sync_delay=tau,
        mix=alpha,
    )
    trainer, state = make(task, mesh, INNER, periodic=("slice", rule))
    params = jax.tree.map(lambda x: np.asarray(x[0]), jax.device_get(state.params))
    groups = trainer.periodic_programs.groups
    assert [i for g in groups for i in g] == list(range(len(jax.tree.leaves(params))))
    state = run(trainer, state, STEPS)
    want_outer, want_replicas = reference(
        params, task.batches(BATCH, seed=0), groups, tau, alpha, codec
    )
    got_outer = jax.tree.leaves(outer_tree(trainer, state))
    got_replicas = jax.tree.leaves(jax.device_get(state.params))
    for i, (o, w) in enumerate(zip(got_outer, want_outer, strict=True)):
        np.testing.assert_allclose(o, w, rtol=0, atol=3e-7, err_msg=f"outer leaf {i}")
    for r in range(REPLICAS):
        for i, (g, w) in enumerate(zip(got_replicas, want_replicas[r], strict=True)):
            np.testing.assert_allclose(g[r], w, rtol=0, atol=3e-7, err_msg=f"replica {r} leaf {i}")


def test_a_skipped_sync_restarts_every_replica_from_the_kept_outer_params(task, mesh):
    """Whatever ``mix``: a non-finite mean of what was sent keeps the outer state, and the
    replicas drop their diverged params rather than mix them in."""
    rule = AxisRule(every_steps=2, outer_optimizer=optax.sgd(**OUTER), sync_delay=1, mix=0.5)
    trainer, state = make(task, mesh, INNER, periodic=("slice", rule))
    before = jax.tree.leaves(outer_tree(trainer, state))
    batches = iter(task.batches(BATCH, seed=0))
    for step in (1, 2, 3):
        state, metrics = trainer.step(state, next(batches), with_stats=False)
        if step == 2:  # one replica diverges before it sends
            state = state._replace(
                params=jax.tree.map(lambda x: x.at[1].set(jnp.nan), state.params)
            )
        state, metrics = trainer.sync(state, step, metrics)
        jax.block_until_ready(state)
    assert metrics["sync/slice/skipped"] == 1.0
    after = jax.tree.leaves(outer_tree(trainer, state))
    for b, a, r in zip(before, after, jax.tree.leaves(jax.device_get(state.params)), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r[0], a)
        np.testing.assert_array_equal(r[1], a)
