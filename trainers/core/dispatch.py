"""How a `Trainer` compiles and dispatches its step programs.

A level's step function (`trainers.core.step`) becomes one jitted program that donates the
state, packs the metrics and per-layer statistics into one vector (one transfer to the host),
takes the highest stop vote of all devices (`trainers.core.stop_vote`) and, with a periodic
axis, runs every replica alone. The programs a run will meet are compiled together before its
first step (`StepDispatch.compile_run`, which `Trainer.fit` calls; `compile_levels` for chosen
levels), any other when a step first needs it (`trainers.core.programs`), then dispatched by
`StepDispatch.step`; a periodic axis's programs run after it (`StepDispatch.sync`).

`StepDispatch` is a base class of `trainers.core.trainer.Trainer`, whose ``__init__`` sets the
attributes it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from trainers.core.metrics import COMPILE_TIME, StepMetrics, pack_diagnostics, stack_metrics
from trainers.core.periodic import Periodic
from trainers.core.placement import Placement
from trainers.core.programs import ProgramKey, StepPrograms, Traced, keys_in_run
from trainers.core.step_levels import HISTOGRAMS, LAYERS, PLAIN, STATS
from trainers.core.step_types import TrainState, TrainStep
from trainers.core.stop_vote import STOP_VOTE_KEY
from xshard.errors import ConfigError
from xshard.reduce.gradients import PerShardGradientsRequired
from xshard.stats.layers import leaf_names


class StepDispatch(Placement):
    """Lowers, compiles and runs a `Trainer`'s step programs, and its periodic axis's.

    Attributes (set by `Trainer.__init__`):
      periodic: the periodic axis (`trainers.core.periodic`), or None.
      agree_stop: whether the steps take the processes' stop votes.
      programs: the compiled step programs (`compile_run`: those of a run, before its first
        step).
      compile_seconds: the run's compile seconds so far; None before the first compilation.
    """

    periodic: Periodic | None
    agree_stop: bool
    programs: StepPrograms
    compile_seconds: float | None
    _step_fns: dict[int, TrainStep]
    _warmup_fns: dict[int, TrainStep]
    _vote_sharding: NamedSharding
    _vote_arrays: dict[int, jax.Array]
    _report_compile: bool

    def lower(self, level: int, state: TrainState, batch: dict[str, Any]) -> jax.stages.Lowered:
        """Traces and lowers the program of `level` for `state` and batches like `batch`
        (global arrays), without compiling it: its StableHLO (`Lowered.as_text`) says which
        dtypes the step computes in, before the compiler's rewrites."""
        return self._lower(ProgramKey(level), state, batch).lowered

    def _lower(self, key: ProgramKey, state: TrainState, batch: dict[str, Any]) -> Traced:
        """`lower`, with what the tracing recorded (metric keys, per-layer layouts)."""
        shardings = self.state_shardings(state)
        keys: list[tuple[str, ...]] = []
        layouts: list[dict[str, tuple[int, ...]]] = []
        step_fn = (self._warmup_fns if key.warmup else self._step_fns)[key.level]

        def run(state, batch, vote):
            state, metrics, diag = step_fn.fn(state, batch)
            if vote is not None:  # agree_stop: the highest vote of all devices
                metrics = {**metrics, STOP_VOTE_KEY: vote}
            names, values = stack_metrics(metrics)
            keys.append(names)  # at trace time
            # The per-layer statistics travel in the same vector: one transfer to the host.
            shapes, tail = pack_diagnostics(diag)
            layouts.append(shapes)
            return state, jnp.concatenate([values, tail])

        def train_step(state, batch, *votes):
            vote = jnp.max(votes[0]) if votes else None
            if self.periodic is not None:  # every replica alone: a row of metrics each
                return self.periodic.inner(run, state, batch, vote)
            return run(state, batch, vote)

        jitted = jax.jit(
            train_step,
            in_shardings=(shardings, self.batch_sharding)
            + ((self._vote_sharding,) if self.agree_stop else ()),
            out_shardings=(shardings, None),
            donate_argnums=(0,),
        )
        try:
            with jax.set_mesh(self.mesh):
                lowered = jitted.lower(state, batch, *self._votes(0))
        except PerShardGradientsRequired as e:
            raise ConfigError(
                f"trainer.grad_impl={self.spec.grad_impl!r} computes no per-shard gradients, "
                f"but the optimizer needs them: {e} Use trainer.grad_impl=manual, or a reduction "
                "without per-shard clipping or weights (reduction.clip_per_shard=null)."
            ) from None
        return Traced(lowered, keys[0], layouts[0], frozenset(step_fn.stats_keys))

    def _compile(
        self, keys: Sequence[ProgramKey], state: TrainState, batch: dict[str, jax.Array]
    ) -> None:
        """Compiles the programs of `keys` for `state` and batches like `batch` (global)."""
        seconds = self.programs.compile(
            keys, lambda key: self._lower(key, state, batch), tuple(leaf_names(state.params))
        )
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        self._report_compile = True

    @property
    def compiled(self) -> jax.stages.Compiled | None:
        """The compiled step of the lowest level compiled so far (plain steps, the most
        frequent: for HLO, cost and memory analysis); None before the first compilation."""
        return next(iter(self.programs.by_level().values()), None)

    def executable_for(self, level: int, warmup: bool = False) -> jax.stages.Compiled | None:
        """The compiled step that runs (warm-up) steps of `level` (None: not compiled yet)."""
        return self.programs.get(ProgramKey(level, warmup))

    def compile_levels(
        self, state: TrainState, batch: dict[str, Any], levels: Iterable[int]
    ) -> None:
        """Compiles, ahead of time, the programs that run steps of `levels` (those not
        compiled yet), for `state` and batches like `batch` (host-local or global)."""
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        missing = [ProgramKey(lv) for lv in sorted(set(levels))]
        missing = [key for key in missing if self.programs.get(key) is None]
        if missing:
            self._compile(missing, state, batch)

    def compile_run(
        self,
        state: TrainState,
        batch: dict[str, Any],
        first: int,
        num_steps: int,
        periods: dict[str, int],
    ) -> None:
        """Compiles, concurrently, the step programs that steps `first` .. `num_steps` will run
        (`keys_in_run` from the `periods` of `step_level`, the periodic axis's warm-up ones
        for its warm-up steps), those not compiled yet: no statistics step compiles in the
        middle of the run. The seconds join `compile_seconds`, reported with the next step."""
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        periodic = self.periodic
        warmup_steps = periodic.rule.warmup_steps if periodic and self._warmup_fns else 0
        keys = keys_in_run(first, num_steps, warmup_steps, periods)
        missing = sorted(key for key in keys if self.programs.get(key) is None)
        if missing:
            self._compile(missing, state, batch)

    def executables(self) -> dict[int, jax.stages.Compiled]:
        """Every compiled step so far, by the level it serves, lowest first."""
        return self.programs.by_level()

    def step(
        self,
        state: TrainState,
        batch: dict[str, Any],
        *,
        with_stats: bool = True,
        layer_stats: bool = False,
        histograms: bool = False,
        stop_vote: int = 0,
        warmup: bool = False,
    ) -> tuple[TrainState, StepMetrics]:
        """One update on `batch` (host-local NumPy or global arrays). Donates `state`.

        The step is compiled ahead of time on first use (the program of each level on the
        first step that needs it); later calls reuse it (a batch of another shape is an
        error, never a silent recompilation). The metrics are a
        mapping of floats, fetched from the device on first read.

        Args:
          state: the state to update (donated).
          batch: the step's batch.
          with_stats: compute the update/param norms, the reduced gradient's norm and the
            per-shard statistics (about one kernel per parameter each); without them the
            metrics leave them out.
          layer_stats: also the per-layer norms of the applied gradient and of the new params
            (`StepMetrics.diagnostics`); implies `with_stats`.
          histograms: also gradient histograms per layer; implies `layer_stats`.
          stop_vote: with `agree_stop`, this process's `StopVote.encode`, reduced over all
            processes into the hidden metric `STOP_VOTE_KEY`.
          warmup: run a warm-up step of the periodic axis (its own programs: the gradient
            reduced over that axis too, as `reduction=mean` would); `fit` passes it for
            steps 1 to ``warmup_steps`` (`Periodic.in_warmup`).

        Returns:
          (the new state, its `StepMetrics`).
        """
        if isinstance(next(iter(jax.tree.leaves(batch))), np.ndarray):
            batch = self.global_batch(batch)
        level = (
            HISTOGRAMS if histograms else LAYERS if layer_stats else STATS if with_stats else PLAIN
        )
        if warmup and not self._warmup_fns:
            raise ValueError("warmup=True needs a periodic axis with warmup_steps > 0.")
        key = ProgramKey(level, warmup)
        if self.programs.get(key) is None:
            self._compile([key], state, batch)
        executable = self.programs.get(key)
        assert executable is not None
        state, values = executable(state, batch, *self._votes(stop_vote))
        return state, self.programs.metrics(level, values)

    def sync(
        self, state: TrainState, step: int, metrics: StepMetrics
    ) -> tuple[TrainState, StepMetrics]:
        """After update `step`: the periodic axis's program due, if any
        (`trainers.core.periodic_programs`): the switch from the warm-up after step
        ``warmup_steps``, or the sync of a fragment (`xshard.reduce.periodic.due_fragment`), whose
        statistics join the step's metrics; else `state` and `metrics` as they are. Donates
        `state` when a program runs. Each program is compiled when first needed.
        """
        if self.periodic_programs is None:
            return state, metrics
        done = self.periodic_programs.after_step(state, step, metrics, self.state_shardings)
        if done.compile_seconds:
            self.compile_seconds = (self.compile_seconds or 0.0) + done.compile_seconds
            self._report_compile = True
        return done.state, done.metrics

    def sync_executable(self, fragment: int = 0) -> jax.stages.Compiled | None:
        """The compiled sync program of `fragment` (None: not compiled yet, or no periodic
        axis)."""
        programs = self.periodic_programs
        return None if programs is None else programs.sync_executable(fragment)

    def _votes(self, vote: int) -> tuple[jax.Array, ...]:
        """The step's vote input: this process's `vote` on each of its devices (cached); none
        without `agree_stop`."""
        if not self.agree_stop:
            return ()
        if vote not in self._vote_arrays:
            self._vote_arrays[vote] = jax.make_array_from_callback(
                (self.mesh.size,), self._vote_sharding, lambda _: np.full((1,), vote, np.int32)
            )
        return (self._vote_arrays[vote],)

    def with_compile_time(self, metrics: StepMetrics) -> StepMetrics:
        """`metrics` with `COMPILE_TIME` (the run's compile seconds so far) if a program was
        compiled since the last call: once per compiling step."""
        if not self._report_compile:
            return metrics
        assert self.compile_seconds is not None  # set by the compilation
        self._report_compile = False
        return metrics.with_host_values(**{COMPILE_TIME: self.compile_seconds})
