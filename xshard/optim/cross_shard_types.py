"""The types of a `cross_shard` optimizer: its settings, its state, its phases and the
transformation that carries them (moved out of `xshard.optim.cross_shard`, which builds and runs
them, to keep that module to the update's steps).

`xshard.optim.cross_shard` re-exports every name here; import them from either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import optax

from xshard.config.reduction import Reduction
from xshard.guard.update import SkipIfNonFiniteState
from xshard.optim.packed import PackedLeaves
from xshard.reduce.gradients import PerShardClipState, divide
from xshard.reduce.hierarchical import all_reduce_bytes_per_axis
from xshard.reduce.per_axis import AxisCommState, AxisReductions
from xshard.stats.layers import Histograms
from xshard.stats.shards import LocalNorms, ShardStats
from xshard.stats.tree import GradSummary, tree_max_abs, tree_sq_norm


@dataclasses.dataclass(frozen=True)
class CrossShardSpec:
    """The settings of a `cross_shard` optimizer, checked and parsed, for code that runs it
    (the trainer reads them from `CrossShardTransformation.spec`)."""

    reduction: Reduction
    axis_name: tuple[str, ...]
    clip_per_shard: float | None
    comm_dtype: Any
    skip_nonfinite: bool
    track_stats: bool
    num_shards: int | None = None
    #: The per-axis rules (`xshard.reduce.per_axis`): none by default.
    axes: AxisReductions = AxisReductions()
    #: The inner optimizer, as given (`xshard.optim.cross_shard.over_axes` rebuilds around it).
    inner: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def step_axes(self) -> tuple[str, ...]:
        """The axes the step's collectives cross: `axis_name` less the periodic ones."""
        return self.axes.step_axes(self.axis_name)

    def mode_bytes_per_step(
        self, mesh_shape: Mapping[str, int], size: int, itemsize: int
    ) -> dict[str, int]:
        """Bytes one device sends per step over each axis the reduction's mode reduces (the
        step axes without a rule), to reduce `size` gradient elements of `itemsize` bytes (of
        ``comm_dtype``'s where set): `xshard.reduce.hierarchical.all_reduce_bytes_per_axis`."""
        if self.comm_dtype is not None:
            itemsize = jnp.dtype(self.comm_dtype).itemsize
        axes = self.axes.mode_axes(self.axis_name)
        return all_reduce_bytes_per_axis([(a, mesh_shape[a]) for a in axes], size, itemsize)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalReduction:
    """What the first phase of a `cross_shard` update leaves for the second (`CrossShardPhases`).

    Attributes:
      updates: the reduced gradient (whole on every shard, or its slice after a scatter), or,
        where `mean_over` > 1, the sum whose mean it is.
      clip: the per-shard clip's new state (`optax.EmptyState()` without one).
      shards: the local gradients' norms (`xshard.stats.shards.local_norms`; None where no
        per-shard gradients existed).
      parts: the buffers holding `updates`, packed per dtype (`xshard.reduce.gradients.Reduced`), or
        None: its leaves.
      comm: the new state of the every-step axis rules (`xshard.reduce.per_axis.AxisCommState` by
        axis), or None without them.
      mean_over: the shard count MEAN still divides `updates` by (static; 1: reduced).
      unpack: ``unpack(parts) -> updates`` where `parts` is set (static): `gradient` slices
        the leaves out of the buffers where it is called, so that the slices fuse into the
        consumers (inside the guard's branch, not before it as the branch's operands).
    """

    updates: Any
    clip: PerShardClipState | optax.EmptyState
    shards: LocalNorms | None
    parts: tuple[jax.Array, ...] | None = None
    comm: dict[str, AxisCommState] | None = None
    mean_over: int = dataclasses.field(default=1, metadata={"static": True})
    unpack: Callable[[Any], Any] | None = dataclasses.field(default=None, metadata={"static": True})

    def gradient(self) -> Any:
        """The reduced gradient, divided where it is read (``pmean``'s arithmetic): call it in
        the computation that consumes it, so that XLA fuses the slicing and the division
        there."""
        if self.parts is None or self.unpack is None:
            return divide(self.updates, self.mean_over)
        return self.unpack(divide(list(self.parts), self.mean_over))

    def sq_norm(self) -> jax.Array:
        """The squared global norm of `gradient` (float32), read from the packed buffers."""
        if self.parts is None:
            return tree_sq_norm(self.gradient())
        return tree_sq_norm(divide(list(self.parts), self.mean_over))

    def max_abs(self) -> jax.Array:
        """max |`gradient`| (float32, NaN-propagating), read from the packed buffers: one
        reduction over them, not one per leaf."""
        if self.parts is None:
            return tree_max_abs(self.gradient())
        return tree_max_abs(list(self.parts)) / self.mean_over


class Applied(NamedTuple):
    """`CrossShardPhases.apply`'s result."""

    params: Any  # the new params
    state: CrossShardState  # the optimizer's new state
    measured: Any  # the caller's measurements (NaN off statistics steps; None without)


class CrossShardPhases(NamedTuple):
    """A `cross_shard` update in two phases, for trainers that run them in different places.

    ``reduce(grads, params, *, shard_weight=None, with_stats=None, scatter_dims=None)`` runs
    where the per-shard gradients are (inside ``shard_map``): per-shard clip, the local
    statistics and the reduction, optionally a reduce-scatter
    (`xshard.reduce.gradients.all_reduce`'s ``scatter_dims``); it returns a `LocalReduction`.
    ``finish(local, state, params, *, with_stats=None, layer_norms=None, histograms=None, **extra)``
    runs the summary, the guard and the inner optimizer on the reduced gradient, anywhere (e.g.
    under GSPMD on sharded slices, where norms over a sharded tensor are global): it returns
    ``(updates, new state)``. Their composition is the optimizer's ``update``. ``apply(local, state,
    params,
    *, with_stats=None, layer_norms=None, histograms=None, measure=None, **extra)`` is
    ``finish`` followed by `optax.apply_updates`, the addition done in the branch that
    computes the updates (`xshard.guard.update.GuardedUpdate`), so that XLA fuses it with the inner
    update: it returns `Applied`, whose ``measured`` is ``measure(new_params, updates,
    summary)`` (optional) computed in that branch on statistics steps (NaN on the others;
    None without `measure`).
    """

    reduce: Callable[..., LocalReduction]
    finish: Callable[..., tuple[Any, CrossShardState]]
    apply: Callable[..., Applied]


class Recorded(NamedTuple):
    """What a `cross_shard` state records besides the inner optimizer's state: its
    statistics and the guard's counters (held packed in `CrossShardState.stats`)."""

    clip: PerShardClipState | optax.EmptyState  # share of shards clipped (clip_per_shard)
    shards: ShardStats | optax.EmptyState  # per-shard norms before clipping, noise-scale terms
    reduced: GradSummary  # norm, max |g|, non-finite count, leaf norms of the reduced gradient
    histograms: Histograms | optax.EmptyState  # per-leaf histograms of that gradient
    #: the guard's skip counters (`SkipIfNonFiniteState` without its inner state)
    counters: SkipIfNonFiniteState


class CrossShardState(NamedTuple):
    """State of `cross_shard`: what it records (`Recorded`: statistics and the guard's skip
    counters, packed in one vector per dtype, `xshard.optim.packed`: a donated step passes
    two buffers for them, not a dozen), the inner optimizer's state, and the axis rules'.

    Read the records by name (`clip`, `shards`, `reduced`, `histograms`, `guard`,
    `skipped_steps`, `consecutive_skipped`); build a state with `of`. The statistics fields
    hold `optax.EmptyState()` when the optimizer does not record them (no per-shard clipping;
    ``track_stats=False``).
    """

    stats: PackedLeaves  # a `Recorded`, packed
    inner_state: optax.OptState
    #: Per every-step axis rule: residual, compression error norm, bytes (`xshard.reduce.per_axis`).
    comm: dict[str, AxisCommState] | optax.EmptyState = optax.EmptyState()

    @classmethod
    def of(
        cls,
        clip: PerShardClipState | optax.EmptyState,
        shards: ShardStats | optax.EmptyState,
        reduced: GradSummary,
        histograms: Histograms | optax.EmptyState,
        guard: SkipIfNonFiniteState,
        comm: dict[str, AxisCommState] | optax.EmptyState | None = None,
    ) -> CrossShardState:
        """The state of these records, the guard's state (its counters and the inner
        optimizer's state) and the axis rules' state: the arguments, names and order the
        constructor took before the records were packed (``CrossShardState(clip, shards,
        reduced, histograms, guard, comm)``; `comm` None: `optax.EmptyState()`, no axis rules)."""
        counters = guard._replace(inner_state=None)
        packed = PackedLeaves.pack(Recorded(clip, shards, reduced, histograms, counters))
        return cls(packed, guard.inner_state, optax.EmptyState() if comm is None else comm)

    @property
    def recorded(self) -> Recorded:
        """The statistics and the guard's counters, unpacked."""
        return self.stats.unpack()

    @property
    def clip(self) -> PerShardClipState | optax.EmptyState:
        """The per-shard clip's record (`Recorded.clip`)."""
        return self.recorded.clip

    @property
    def shards(self) -> ShardStats | optax.EmptyState:
        """The per-shard statistics (`Recorded.shards`)."""
        return self.recorded.shards

    @property
    def reduced(self) -> GradSummary:
        """The reduced gradient's summary (`Recorded.reduced`)."""
        return self.recorded.reduced

    @property
    def histograms(self) -> Histograms | optax.EmptyState:
        """The reduced gradient's histograms (`Recorded.histograms`)."""
        return self.recorded.histograms

    @property
    def guard(self) -> SkipIfNonFiniteState:
        """The guard's state: its skip counters around the inner optimizer's state."""
        return self.recorded.counters._replace(inner_state=self.inner_state)

    @property
    def skipped_steps(self) -> jax.Array:
        """int32: steps skipped because the reduced gradient was not finite."""
        return self.recorded.counters.total_notfinite

    @property
    def consecutive_skipped(self) -> jax.Array:
        """int32: skipped steps in a row, reset by a finite step."""
        return self.recorded.counters.notfinite_count


class CrossShardTransformation(optax.GradientTransformationExtraArgs):
    """What `cross_shard` returns: an `optax.GradientTransformationExtraArgs` that also says
    how it was built (`spec`) and splits its update in two (`phases`).

    It is optax's pair ``(init, update)``, so optax takes it wherever it takes a
    transformation (``optax.chain``, ``optax.apply_if_finite``, ``optax.partition``,
    ``isinstance(tx, optax.GradientTransformationExtraArgs)``); `spec` and `phases` are
    attributes, not fields, for code that runs the phases in different places
    (`trainers.Trainer`). A copy made with ``_replace`` has another update: it is a plain
    `optax.GradientTransformationExtraArgs`.
    """

    def __new__(
        cls,
        init: optax.TransformInitFn,
        update: optax.TransformUpdateExtraArgsFn,
        spec: CrossShardSpec,
        phases: CrossShardPhases,
    ) -> Self:
        self = super().__new__(cls, init, update)
        self.__dict__.update(_spec=spec, _phases=phases)
        return self

    @property
    def spec(self) -> CrossShardSpec:
        """The settings it was built with, checked and parsed."""
        return self.__dict__["_spec"]

    @property
    def phases(self) -> CrossShardPhases:
        """Its update in two phases: `CrossShardPhases`."""
        return self.__dict__["_phases"]

    def _replace(self, /, **fields: Any) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(**(self._asdict() | fields))

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy.copy, pickle
        return (*self, self.spec, self.phases)


# A pytree like optax's pair (its two functions), `spec` and `phases` its static data.
jax.tree_util.register_pytree_node(
    CrossShardTransformation,
    lambda tx: (tuple(tx), (tx.spec, tx.phases)),
    lambda static, pair: CrossShardTransformation(*pair, *static),  # type: ignore[call-arg]
)
