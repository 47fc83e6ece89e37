"""The train step: gradients (per shard or GSPMD), microbatch accumulation, update, statistics.

Two ways to get the gradient, one result:

* ``manual`` (default): ``jax.shard_map`` is manual over the data-parallel axes and automatic
  over the model axes. Params are cast to varying, so ``jax.grad`` gives each shard's own
  gradient; per-shard statistics are taken; the cross-shard optimizer reduces.
* ``gspmd``: ``jax.grad`` of the global-mean loss under plain ``jit``; the compiler inserts the
  reduction, and the cross-shard optimizer sees an already reduced gradient (MEAN = identity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xshard import Reduction
from xshard.config.run import GRAD_IMPLS
from xshard.errors import ConfigError
from xshard.slots import cross_shard_state, get_hyperparams
from xshard.stats import histogram, layer_norms, noise_scale, shard_norm_stats, tree_norm


class TrainState(NamedTuple):
    """Everything that changes during training. The RNG is a pure function of (seed, step)."""

    step: jax.Array  # int32 scalar: number of updates applied
    params: Any
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of the step (hashable; changing it means a new compilation)."""

    data_axes: tuple[str, ...]
    num_data_shards: int
    global_batch_size: int
    microbatches: int = 1
    grad_impl: str = "manual"
    reduction: Reduction = Reduction.MEAN
    seed: int = 0


@jax.tree_util.register_pytree_node_class
class StepMetrics(Mapping[str, float]):
    """A step's scalar metrics: one device vector, fetched to the host once, on first read.

    Reading any key waits for the step to finish. Fetching one stacked vector instead of a
    dict of ~20 scalars saves a device-to-host transfer per metric every step. It is a pytree
    (of that vector), so `jax.block_until_ready(metrics)` works.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: jax.Array,
        host: dict[str, float] | None = None,
        hidden: frozenset[str] = frozenset(),
    ):
        self.keys_ = tuple(keys)
        self.values = values
        self.hidden = hidden  # not computed on this step (statistics on a plain step)
        self._host = dict(host or {})
        self._device: dict[str, float] = {}
        self._fetched = False

    def with_host_values(self, **values: float) -> StepMetrics:
        """A copy with extra host-side values (e.g. the compile time) merged in."""
        return StepMetrics(self.keys_, self.values, {**self._host, **values}, self.hidden)

    def _fetch(self) -> dict[str, float]:
        if not self._fetched:
            device = np.asarray(jax.device_get(self.values)).tolist()
            self._device = dict(zip(self.keys_, device, strict=True))
            shown = {k: v for k, v in self._device.items() if k not in self.hidden}
            self._host = {**shown, **self._host}
            self._fetched = True
        return self._host

    def device_value(self, key: str) -> float:
        """The step's value of `key`, hidden or not (fetches the step's metrics)."""
        self._fetch()
        return self._device[key]

    def tree_flatten(self):
        return (self.values,), (self.keys_, tuple(self._host.items()), self.hidden)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], children[0], dict(aux[1]), aux[2])

    def __getitem__(self, key: str) -> float:
        return self._fetch()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())


def stack_metrics(metrics: dict[str, jax.Array]) -> tuple[tuple[str, ...], jax.Array]:
    """(sorted keys, float32 vector of their values), for use inside the compiled step."""
    keys = tuple(sorted(metrics))
    return keys, jnp.stack([jnp.asarray(metrics[k], jnp.float32) for k in keys])


def step_rng(seed: int, step: jax.Array) -> jax.Array:
    """The step's RNG key: a pure function of (seed, step), so a resumed run draws the same."""
    return jax.random.fold_in(jax.random.key(seed), step)


def _split_microbatches(batch: Any, k: int) -> Any:
    """(b, ...) -> (k, b // k, ...): microbatch j holds rows j, j + k, j + 2k, ..."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)


def loss_and_grads(loss_fn: Callable, params: Any, batch: Any, rng: jax.Array, k: int):
    """Mean loss, mean aux and mean gradient over `k` microbatches of `batch`.

    Gradients accumulate in float32 across a `lax.scan` and are cast back to the params'
    dtypes once at the end; nothing is reduced across shards here.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if k == 1:
        (loss, aux), grads = grad_fn(params, batch, rng)
        return loss, aux, grads

    def body(acc, xs):
        mb, i = xs
        (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(rng, i))
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return acc, (loss, aux)

    acc0 = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    acc, (losses, auxes) = jax.lax.scan(body, acc0, (_split_microbatches(batch, k), jnp.arange(k)))
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    return jnp.mean(losses), jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes), grads


def _optimizer_metrics(opt_state) -> dict[str, jax.Array]:
    """Scalars the optimizer state already holds: free to report every step."""
    cs = cross_shard_state(opt_state)
    metrics = {
        "grad/global_norm": cs.reduced.norm,
        "grad/max_abs": cs.reduced.max_abs,
        "grad/nonfinite": cs.reduced.nonfinite,
        "train/skipped_steps": cs.skipped_steps,
        "train/consecutive_skipped": cs.consecutive_skipped,
    }
    lr = get_hyperparams(opt_state).get("learning_rate")
    if lr is not None:
        metrics["optim/learning_rate"] = jnp.asarray(lr, jnp.float32)
    return metrics


def _norm_metrics(new_params, updates) -> dict[str, jax.Array]:
    # Only the new params are read: reading the old ones after the update would make XLA
    # copy the donated params every step.
    param_norm = tree_norm(new_params)
    update_norm = tree_norm(updates)
    return {
        "optim/update_norm": update_norm,
        "optim/update_param_ratio": update_norm / jnp.maximum(param_norm, 1e-12),
        "params/global_norm": param_norm,
    }


def _when(with_stats: jax.Array, compute: Callable[[], dict[str, jax.Array]]):
    """`compute()` on statistics steps, NaNs (never reported) on the others: one executable."""
    shapes = jax.eval_shape(compute)
    skip = lambda: {k: jnp.full(v.shape, jnp.nan, v.dtype) for k, v in shapes.items()}
    return jax.lax.cond(with_stats, compute, skip)


def _shard_metrics(local_grads, reduced_norm, spec: StepSpec) -> dict[str, jax.Array]:
    stats = shard_norm_stats(local_grads, spec.data_axes)
    metrics = {f"grad/{k}": v for k, v in stats.items() if k != "shard_sq_norm_mean"}
    n = spec.num_data_shards
    if n > 1:
        mean_norm = reduced_norm / (n if spec.reduction is Reduction.SUM else 1)
        noise = noise_scale(
            stats["shard_sq_norm_mean"],
            jnp.square(mean_norm),
            spec.global_batch_size // n,
            spec.global_batch_size,
        )
        metrics.update({f"grad/{k}": v for k, v in noise.items()})
    return metrics


def make_train_step(task: Any, tx: optax.GradientTransformation, mesh: Mesh, spec: StepSpec):
    """Returns ``step(state, batch, with_stats) -> (state, metrics)``, to be jitted.

    `with_stats` is a traced bool: the norms of the update and params and the per-shard
    statistics (the costly part, ~1 kernel per parameter each) are computed under a
    `lax.cond` only when it is true, so statistics steps and plain steps share one
    executable. On plain steps those metrics are NaN; the returned function's `stats_keys`
    (filled when it is traced) names them.
    """
    if spec.grad_impl not in GRAD_IMPLS:
        raise ConfigError(
            f"trainer.grad_impl={spec.grad_impl!r} is not allowed; choose one of {GRAD_IMPLS}."
        )
    axes = spec.data_axes
    # The optimizer records the reduced gradient's norm only on statistics steps.
    stats_keys: set[str] = {"grad/global_norm"}

    def when_stats(with_stats, compute):
        stats = _when(with_stats, compute)
        stats_keys.update(stats)
        return stats

    def apply(params, opt_state, grads, with_stats):
        updates, opt_state = tx.update(grads, opt_state, params, with_stats=with_stats)
        return optax.apply_updates(params, updates), opt_state, updates

    def manual(state: TrainState, batch, with_stats):
        def per_shard(params, opt_state, batch, rng, with_stats):
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
            local = jax.lax.pcast(params, axes, to="varying")
            loss, aux, grads = loss_and_grads(task.loss, local, batch, rng, spec.microbatches)
            new_params, opt_state, updates = apply(params, opt_state, grads, with_stats)
            metrics = _optimizer_metrics(opt_state)
            reduced_norm = metrics["grad/global_norm"]
            metrics |= when_stats(
                with_stats,
                lambda: (
                    _norm_metrics(new_params, updates) | _shard_metrics(grads, reduced_norm, spec)
                ),
            )
            metrics["train/loss"] = jax.lax.pmean(loss, axes)
            metrics |= {f"train/{k}": jax.lax.pmean(v, axes) for k, v in aux.items()}
            return new_params, opt_state, metrics

        params, opt_state, metrics = jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(P(), P(), P(axes), P(), P()),
            out_specs=(P(), P(), P()),
            axis_names=set(axes),
        )(state.params, state.opt_state, batch, step_rng(spec.seed, state.step), with_stats)
        return TrainState(state.step + 1, params, opt_state), metrics

    def gspmd(state: TrainState, batch, with_stats):
        rng = step_rng(spec.seed, state.step)
        loss, aux, grads = loss_and_grads(task.loss, state.params, batch, rng, spec.microbatches)
        params, opt_state, updates = apply(state.params, state.opt_state, grads, with_stats)
        metrics = _optimizer_metrics(opt_state)
        metrics |= when_stats(with_stats, lambda: _norm_metrics(params, updates))
        metrics["train/loss"] = loss
        metrics |= {f"train/{k}": v for k, v in aux.items()}
        return TrainState(state.step + 1, params, opt_state), metrics

    step = manual if spec.grad_impl == "manual" else gspmd
    step.stats_keys = stats_keys
    return step


def make_diagnostics(task: Any, mesh: Mesh, spec: StepSpec, *, histograms: bool):
    """Returns ``diag(state, batch) -> dict``: per-parameter norms (and gradient histograms).

    Run on the few steps that log them, before the step itself, on the same batch. The
    gradient here is that of the global-mean loss (the MEAN over shards).
    """

    def mean_grads(params, batch, rng):
        if spec.grad_impl == "gspmd":
            return loss_and_grads(task.loss, params, batch, rng, spec.microbatches)[2]

        def per_shard(params, batch, rng):
            local = jax.lax.pcast(params, spec.data_axes, to="varying")
            rng = jax.random.fold_in(rng, jax.lax.axis_index(spec.data_axes))
            grads = loss_and_grads(task.loss, local, batch, rng, spec.microbatches)[2]
            return jax.lax.pmean(grads, spec.data_axes)

        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(P(), P(spec.data_axes), P()),
            out_specs=P(),
            axis_names=set(spec.data_axes),
        )(params, batch, rng)

    def diag(state: TrainState, batch) -> dict[str, Any]:
        grads = mean_grads(state.params, batch, step_rng(spec.seed, state.step))
        out: dict[str, Any] = {
            "grad_norms": layer_norms(grads),
            "param_norms": layer_norms(state.params),
        }
        if histograms:
            out["grad_hist"] = {
                k: histogram(g) for k, g in zip(layer_norms(grads), jax.tree.leaves(grads))
            }
        return out

    return diag
