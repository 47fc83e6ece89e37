"""A step's metrics: what the optimizer state records, named, and carried to the host.

* `StepMetrics` — the scalars as one device vector (fetched once, on first read) and, on the
  steps that log them, the per-layer statistics (`StepMetrics.diagnostics`).
* `state_metrics` — the scalars `cross_shard` and the recorded global clip keep in the
  optimizer state, named as the TensorBoard tags (README, "TensorBoard tags").
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xshard.optim.cross_shard import CrossShardState
from xshard.optim.slots import find_states, get_hyperparams
from xshard.reduce.clipping import GlobalClipState
from xshard.reduce.gradients import PerShardClipState
from xshard.stats.layers import Histograms, as_diagnostics
from xshard.stats.shards import ShardStats
from xshard.stats.tree import noise_scale

#: The tag of the run's compile time so far, in the metrics of each step that compiled a
#: program (`trainers.core.trainer.Trainer` compiles each when a step first needs it).
COMPILE_TIME = "perf/compile_time_s"


def pack_diagnostics(diag: dict[str, Any] | None) -> tuple[dict[str, tuple[int, ...]], jax.Array]:
    """(shapes, vector): the step's per-layer statistics (``grad_norms``, ``param_norms`` and
    ``grad_hist``'s table) as one float32 vector to append to its metrics, and their shapes
    in that order (empty for None). Inside the compiled step."""
    arrays = {}
    for name, value in (diag or {}).items():
        arrays[name] = value.table if isinstance(value, Histograms) else value
    shapes = {name: tuple(x.shape) for name, x in arrays.items()}
    flat = [jnp.ravel(x).astype(jnp.float32) for x in arrays.values()]
    return shapes, jnp.concatenate(flat) if flat else jnp.zeros((0,), jnp.float32)


@jax.tree_util.register_pytree_node_class
class StepMetrics(Mapping[str, float]):
    """A step's scalar metrics: one device vector, fetched to the host once, on first read.

    Reading any key waits for the step to finish. Fetching one stacked vector instead of a
    dict of ~20 scalars saves a device-to-host transfer per metric every step; on the steps
    that log per-layer statistics they follow the metrics in the same vector
    (`pack_diagnostics`), one transfer too. It is a pytree (of that vector), so
    `jax.block_until_ready(metrics)` works.

    Args:
      keys: the names of `values`' first entries.
      values: float32 vector of the metrics, and of the per-layer statistics after them.
      host: host-side values merged in (e.g. the compile time).
      hidden: names not computed on this step (statistics on a plain step).
      diag: on steps that log per-layer statistics, their shapes in `values` after the
        metrics (`pack_diagnostics`): ``grad_norms`` and ``param_norms`` (per leaf) and, on
        histogram steps, ``grad_hist`` (`xshard.stats.layers.Histograms`' table); None on
        other steps.
      diag_names: the leaf names of the rows of the per-layer statistics.
      histograms: whether they hold gradient histograms.
      extra: further ``(keys, vector)`` pairs of device values merged in (a periodic axis's
        sync statistics, `with_device_values`).

    With a periodic mesh axis `values` holds a row per replica (`trainers.core.periodic`):
    the host averages the rows it holds (`host_mean`).
    """

    # The metrics vector. It shadows `Mapping.values()`, which StepMetrics does not offer.
    values: jax.Array  # type: ignore[assignment]

    def __init__(
        self,
        keys: Sequence[str],
        values: jax.Array,
        host: dict[str, float] | None = None,
        hidden: frozenset[str] = frozenset(),
        diag: dict[str, Any] | None = None,
        diag_names: Sequence[str] = (),
        histograms: bool = False,
        extra: tuple[tuple[tuple[str, ...], jax.Array], ...] = (),
    ):
        self.keys_ = tuple(keys)
        self.extra = tuple(extra)
        self.values = values
        self.hidden = hidden  # not computed on this step (statistics on a plain step)
        self.diag = diag
        self.diag_names = tuple(diag_names)
        self.histograms = histograms
        self._host = dict(host or {})
        self._device: dict[str, float] = {}
        self._fetched = False
        self._array: np.ndarray | None = None
        self._diagnostics: dict[str, Any] | None = None

    def with_host_values(self, **values: float) -> StepMetrics:
        """A copy with extra host-side values (e.g. the compile time) merged in."""
        return StepMetrics(
            self.keys_,
            self.values,
            {**self._host, **values},
            self.hidden,
            self.diag,
            self.diag_names,
            self.histograms,
            self.extra,
        )

    def with_device_values(self, keys: Sequence[str], values: jax.Array) -> StepMetrics:
        """A copy with the device vector `values` (named by `keys`) merged in, fetched with
        the rest."""
        return StepMetrics(
            self.keys_,
            self.values,
            self._host,
            self.hidden,
            self.diag,
            self.diag_names,
            self.histograms,
            (*self.extra, (tuple(keys), values)),
        )

    @property
    def diagnostics(self) -> dict[str, Any] | None:
        """Per-layer statistics of this step, fetched on first read, as `Hook.on_diagnostics`
        receives them: ``grad_norms`` and ``param_norms`` ({name: float}) and, on histogram
        steps, ``grad_hist`` ({name: {min, max, num, sum, sum_squares, bucket_limits,
        bucket_counts}}). The gradient is the one the optimizer applied (reduced, after
        per-shard clipping), the params those after the update. None on other steps."""
        if self.diag is None:
            return None
        if self._diagnostics is None:
            self._fetch()
            assert self._array is not None  # set by _fetch
            host, start = {}, len(self.keys_)
            for name, shape in self.diag.items():
                size = math.prod(shape)
                host[name] = self._array[start : start + size].reshape(shape)
                start += size
            self._diagnostics = as_diagnostics(
                list(self.diag_names),
                host["grad_norms"],
                host["param_norms"],
                Histograms(host["grad_hist"]) if self.histograms else None,
            )
        return self._diagnostics

    def host_values(self) -> dict[str, float]:
        """The metrics as a new dict (fetched once): ``dict(metrics)`` without a lookup per
        key, which `Trainer.fit` hands to its hooks every step."""
        return dict(self._fetch())

    def _fetch(self) -> dict[str, float]:
        if not self._fetched:
            self._array = host_mean(self.values)
            device = self._array[: len(self.keys_)].tolist()
            self._device = dict(zip(self.keys_, device, strict=True))
            for keys, values in self.extra:
                self._device |= dict(zip(keys, host_mean(values).tolist(), strict=True))
            shown = {k: v for k, v in self._device.items() if k not in self.hidden}
            self._host = {**shown, **self._host}
            self._fetched = True
        return self._host

    def device_value(self, key: str) -> float:
        """The step's value of `key`, hidden or not (fetches the step's metrics)."""
        self._fetch()
        return self._device[key]

    def tree_flatten(self):
        aux = (
            self.keys_,
            tuple(self._host.items()),
            self.hidden,
            None if self.diag is None else tuple(self.diag.items()),
            self.diag_names,
            self.histograms,
            tuple(keys for keys, _ in self.extra),
        )
        return (self.values, *(values for _, values in self.extra)), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, host, hidden, diag, names, histograms, extra_keys = aux
        diag = None if diag is None else dict(diag)
        extra = tuple(zip(extra_keys, children[1:], strict=True))
        return cls(keys, children[0], dict(host), hidden, diag, names, histograms, extra)

    def __getitem__(self, key: str) -> float:
        return self._fetch()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())


def host_mean(values: jax.Array) -> np.ndarray:
    """A metrics vector on the host: this process's copy of a replicated vector, or of a
    vector per replica (rows over a periodic axis) the mean of the rows this process holds
    (all of them on one process)."""
    if values.ndim < 2:
        return np.asarray(values)  # replicated: this process's copy
    rows = {}
    for shard in values.addressable_shards:
        for i, row in zip(range(*shard.index[0].indices(values.shape[0])), np.asarray(shard.data)):
            rows[i] = row
    return np.mean(np.stack([rows[i] for i in sorted(rows)]), axis=0)


def stack_metrics(metrics: dict[str, jax.Array]) -> tuple[tuple[str, ...], jax.Array]:
    """(sorted keys, float32 vector of their values), for use inside the compiled step.

    The vector is built by selects on its positions, not stacked: XLA fuses the selects, the
    values' conversions to float32 and the constants (a plain step's NaN statistics) into one
    kernel, where a stack is a concatenation kernel after a conversion kernel per non-float
    value (on mlp 5 of a plain step's ~33 kernels: ~0.1 ms of a ~1.5 ms step on XLA:CPU).
    """
    keys = tuple(sorted(metrics))
    position = jnp.arange(len(keys))
    vector = jnp.zeros(len(keys), jnp.float32)
    for i, key in enumerate(keys):
        vector = jnp.where(position == i, jnp.asarray(metrics[key], jnp.float32), vector)
    return keys, vector


def state_metrics(
    opt_state: CrossShardState,
    *,
    skips: bool,
    per_shard: bool,
    batch_sizes: tuple[int, int],
) -> tuple[dict[str, jax.Array], set[str]]:
    """The scalars the optimizer state records, and which of them only statistics steps have.

    Args:
      opt_state: the `cross_shard` optimizer's state after this step (its statistics, the
        inner optimizer's learning rate and the recorded clip's state).
      skips: whether the optimizer skips non-finite steps (``skip_nonfinite``): only then do
        its skip counters count anything (a plain optax optimizer, wrapped by the trainer,
        skips nothing).
      per_shard: whether per-shard gradients existed (``grad_impl=manual``).
      batch_sizes: (examples per shard, examples per step), for the noise scale.

    Returns:
      (metrics, names of those computed on statistics steps only: NaN on the others).
    """
    cs = opt_state
    assert cs.reduced.max_abs is not None  # a recorded step has measured it
    metrics = {
        "grad/global_norm": cs.reduced.norm,  # the reduced gradient, before the global clip
        "grad/max_abs": cs.reduced.max_abs,
        "grad/nonfinite": cs.reduced.nonfinite,
    }
    stats_only = {"grad/global_norm"}
    if skips:
        metrics["train/skipped_steps"] = cs.skipped_steps
        metrics["train/consecutive_skipped"] = cs.consecutive_skipped
    lr = get_hyperparams(opt_state).get("learning_rate")
    if lr is not None:
        metrics["optim/learning_rate"] = jnp.asarray(lr, jnp.float32)
    clips = find_states(opt_state, GlobalClipState)
    if clips:  # computed on every step by the clip itself
        metrics["grad/clip_fired"] = clips[0].fired
        metrics["grad/clipped_norm"] = clips[0].clipped_norm
    if isinstance(cs.clip, PerShardClipState) and isinstance(cs.shards, ShardStats):
        metrics["grad/shard_clip_fraction"] = cs.clip.clipped_fraction
        stats_only.add("grad/shard_clip_fraction")
    if per_shard and isinstance(cs.shards, ShardStats):
        shard = {
            "grad/shard_norm_mean": cs.shards.norm_mean,
            "grad/shard_norm_max": cs.shards.norm_max,
            "grad/shard_norm_min": cs.shards.norm_min,
            "grad/shard_norm_std": cs.shards.norm_std,
        }
        b_small, b_big = batch_sizes
        if b_big > b_small:
            noise = noise_scale(cs.shards.sq_norm_mean, cs.shards.mean_sq_norm, b_small, b_big)
            shard |= {f"grad/{k}": v for k, v in noise.items()}
        metrics |= shard
        stats_only |= set(shard)
    if isinstance(cs.comm, dict):  # every step: the axis rules' traffic and its error
        for axis, comm in cs.comm.items():
            metrics[f"comm/{axis}/bytes_per_step"] = comm.bytes_sent
            metrics[f"comm/{axis}/compression_error_norm"] = comm.error_norm
    return metrics, stats_only
