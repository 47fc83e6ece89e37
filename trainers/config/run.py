"""The run's own config nodes: ``seed``, ``trainer`` and ``distributed``.

Field types, defaults and checks live here. The composed config gets the keys and defaults
from a permissive copy of each dataclass (`xshard.config.nodes.permissive`), so that a bad
value reaches `read_node` and the user as one line (exit 2), not as a Hydra traceback.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainers.config.early_stopping import EarlyStoppingOptions
from trainers.config.precision import NO_REMAT, check_remat
from xshard.config.nodes import LOCATION, shown
from xshard.config.ranges import MAX_STEPS, MAX_STEPS_SHOWN
from xshard.errors import ConfigError

#: How per-shard gradients are computed: in `jax.shard_map` or by the compiler (GSPMD).
GRAD_IMPLS = ("manual", "gspmd")
#: ``trainer.grad_impl`` that races both paths at start-up and keeps the faster
#: (`trainers.app.grad_path`); the default.
GRAD_IMPL_AUTO = "auto"
#: Keys removed from the run's nodes, and what a user of one should know: an override of one
#: is refused with this (`trainers.app.cli_overrides.removed_key_error`), not with Hydra's "not in
#: struct".
REMOVED_KEYS = {
    "trainer.step_executables": (
        "every kind of step (plain, statistics, per-layer norms, histograms) has its own "
        "compiled program, the design docs/benchmarks.md measured fastest; the others "
        "('one', 'two') are gone, and 'per_level' is what every run does. Delete the override."
    ),
}
#: ``trainer.compilation_cache_dir``'s default: JAX's persistent compilation cache in the user's
#: cache dir (``$XDG_CACHE_HOME``, else ``~/.cache``), shared by every run and sweep job of the
#: user (`trainers.app.compile_cache`).
DEFAULT_COMPILATION_CACHE_DIR = "${oc.env:XDG_CACHE_HOME,'~/.cache'}/xshard/jax"
#: CPU collectives JAX can use between processes.
CPU_COLLECTIVES = ("gloo", "mpi")
#: Seeds are unsigned 32-bit integers (JAX PRNG keys and NumPy generators take them all).
MAX_SEED = 2**32 - 1


def check_int(value: Any, key: str, minimum: int, allowed: str, maximum: int | None = None) -> int:
    """Returns `value` if it is an integer in [minimum, maximum] (not a bool).

    Raises:
      ConfigError: naming `key`, the value and `allowed`.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise ConfigError(f"{key}={shown(value)}: expected an integer, {allowed}.")
    return value


def check_steps(value: Any, key: str, minimum: int, allowed: str) -> int:
    """Returns `value` if it is an integer in [minimum, `MAX_STEPS`]: a step, a number of
    steps or a period in steps (the state's step counter is int32).

    Raises:
      ConfigError: naming `key`, the value and `allowed` with the bound.
    """
    return check_int(value, key, minimum, f"{allowed}, at most {MAX_STEPS_SHOWN}", MAX_STEPS)


#: Periods of the ``trainer`` node that null switches off, as 0 does (read as 0).
OFF_WHEN_NULL = ("layer_stats_every", "histogram_every", "eval_every")
#: The statistics periods of the ``trainer`` node: which kinds of step a run meets
#: (`TrainerOptions.stat_periods`, as `trainers.Trainer.fit` takes them).
STAT_PERIODS = ("stats_every", "layer_stats_every", "histogram_every")


#: Signals `trainer.stop_signals` may name: they stop training cleanly (checkpoint, exit 75).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")


def check_stop_signals(value: Any, key: str = "trainer.stop_signals") -> tuple[str, ...]:
    """Returns the signal names of ``trainer.stop_signals`` if they are allowed.

    Raises:
      ConfigError: naming `key`, the value and the allowed names.
    """
    if not isinstance(value, list | tuple) or not all(v in STOP_SIGNALS for v in value):
        raise ConfigError(
            f"{key}={shown(value)}: expected a list of signal names among {list(STOP_SIGNALS)} "
            "(e.g. [SIGTERM, SIGINT, SIGUSR2])."
        )
    return tuple(value)


def check_seed(value: Any, key: str = "seed") -> int:
    """Returns the run's seed if it is an integer in [0, 2**32 - 1].

    Raises:
      ConfigError: naming `key` and the value.
    """
    return check_int(value, key, 0, f"0 <= {key} <= {MAX_SEED} (2**32 - 1)", MAX_SEED)


#: ``trainer.objective`` values: the final training loss, or a metric of the final evaluation.
TRAIN_OBJECTIVE = "train/loss"
EVAL_PREFIX = "eval/"
EVAL_LOSS = EVAL_PREFIX + "loss"  # every evaluation reports it


def check_objective(value: Any, key: str = "trainer.objective") -> str:
    """Returns ``trainer.objective`` if it is ``train/loss`` or ``eval/<metric>``.

    Whether the task's evaluation has that metric is checked when the run starts.

    Raises:
      ConfigError: naming `key`, the value and what is allowed.
    """
    if not isinstance(value, str) or not (
        value == TRAIN_OBJECTIVE
        or (value.startswith(EVAL_PREFIX) and len(value) > len(EVAL_PREFIX))
    ):
        raise ConfigError(
            f"{key}={shown(value)}: expected {TRAIN_OBJECTIVE!r} (the final training loss) or "
            f"'{EVAL_PREFIX}<metric>' of the final evaluation (e.g. 'eval/loss')."
        )
    return value


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The ``trainer`` node.

    Attributes:
      steps: updates of the whole run (a resumed run continues to this count).
      batch_size: the global batch, split over the data-parallel axes.
      microbatches: gradient accumulation steps per update.
      grad_impl: "manual" (per-shard gradients in shard_map), "gspmd" (grad under plain jit),
        or "auto": both compiled and timed for a few plain steps at start-up, the faster kept
        (a path only one of them supports, per-shard clipping, forces it; a resume runs the
        checkpoint's path).
      log_every: TensorBoard scalars every N steps (the last step always).
      stats_every: update/param norms and per-shard statistics every N steps (0: the last
        only; null: every `log_every`); the loss and the reduced gradient's norm come every
        step.
      layer_stats_every: per-parameter norms every N steps (0 or null: never).
      histogram_every: gradient histograms every N steps (0 or null: never).
      max_consecutive_nonfinite: skipped non-finite steps in a row that are tolerated.
      resume_from: a checkpoints dir, step dir or run dir; used when this run's own
        checkpoints are empty (a rerun in the same dir resumes from those).
      progress: a progress bar on stderr.
      failed_objective: in a multirun, what a failed or diverged job returns to the sweeper;
        null: a failed trial (Optuna counts it against max_failure_rate; the basic sweeper
        goes on); a number: that penalty (e.g. 1e9 when minimising).
      profile_steps: ``[first, last]``: a `jax.profiler` trace of these steps in the run's
        TensorBoard dir; null: none.
      hooks: the user's `trainers.Hook`s, ``[{_target_: mypkg.MyHook, arg: 1}]`` (with
        ``allowed_targets: [mypkg.]``), run after the built-in ones.
      stop_signals: signals that stop training cleanly (checkpoint, exit 75); SIGUSR2 is the
        warning SLURM sends through submitit before the time limit.
      eval_every: evaluate on the task's eval split every N steps and at the end (0 or null:
        only at the end). Tasks without an eval split are not evaluated.
      eval_batches: batches per evaluation, the same ones every time (fewer if the split is
        smaller); 0 disables evaluation.
      eval_batch_size: the global batch of an evaluation; null: ``batch_size``.
      objective: what the Hydra main returns to optimizing sweepers: ``train/loss`` (the
        final training loss) or ``eval/<metric>`` (of the final evaluation, e.g. ``eval/loss``).
      early_stopping: ``{metric, mode, patience, min_delta}``, stop when the metric stops
        improving (`trainers.config.early_stopping`); ``metric: null`` turns it off.
      remat: the rematerialisation policy of the task's layers (`trainers.config.precision`:
        ``none``, ``full``, ``dots_saveable``, ...); a task applies it when its node has
        ``remat: ${trainer.remat}`` (the built-in ones do).
      compilation_cache_dir: JAX's persistent compilation cache (a dir; ``~`` is expanded):
        programs compiled once are read back by later runs and sweep jobs; null: off.
    """

    steps: int = 300
    batch_size: int = 64
    microbatches: int = 1
    grad_impl: str = GRAD_IMPL_AUTO
    log_every: int = 10
    stats_every: int | None = None
    layer_stats_every: int | None = 100
    histogram_every: int | None = 100
    max_consecutive_nonfinite: int = 10
    resume_from: str | None = None
    progress: bool = True
    failed_objective: float | None = None
    profile_steps: list[int] | None = None
    hooks: list[Any] = dataclasses.field(default_factory=list)
    stop_signals: list[str] = dataclasses.field(
        default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR2"]
    )
    eval_every: int | None = 0
    eval_batches: int = 10
    eval_batch_size: int | None = None
    objective: str = TRAIN_OBJECTIVE
    early_stopping: EarlyStoppingOptions = dataclasses.field(default_factory=EarlyStoppingOptions)
    remat: str = NO_REMAT
    compilation_cache_dir: str | None = dataclasses.field(
        default=DEFAULT_COMPILATION_CACHE_DIR, metadata=LOCATION
    )

    def __post_init__(self) -> None:
        self._check_step_shape()
        self._read_periods()
        self._check_run_control()
        self._check_evaluation()
        self._check_extensions()

    def _check_step_shape(self) -> None:
        """``steps``, ``batch_size``, ``microbatches``, ``grad_impl`` and ``log_every``."""
        check_steps(self.steps, "trainer.steps", 1, "the number of updates, >= 1")
        check_int(self.batch_size, "trainer.batch_size", 1, "the global batch size, >= 1")
        check_int(self.microbatches, "trainer.microbatches", 1, ">= 1 (1: no accumulation)")
        if self.grad_impl not in (*GRAD_IMPLS, GRAD_IMPL_AUTO):
            raise ConfigError(
                f"trainer.grad_impl={shown(self.grad_impl)} is not allowed; choose one of "
                f"{[*GRAD_IMPLS, GRAD_IMPL_AUTO]}."
            )
        check_steps(self.log_every, "trainer.log_every", 1, "a period in steps, >= 1")

    def _read_periods(self) -> None:
        """The statistics periods: ``stats_every`` null is ``log_every``, a null of
        `OFF_WHEN_NULL` is 0 (off)."""
        if self.stats_every is None:
            object.__setattr__(self, "stats_every", self.log_every)
        for key in OFF_WHEN_NULL:  # null switches a period off, as 0 does
            if getattr(self, key) is None:
                object.__setattr__(self, key, 0)
        for key in STAT_PERIODS:
            check_steps(
                getattr(self, key), f"trainer.{key}", 0, "a period in steps, 0 or null disables"
            )

    @property
    def stat_periods(self) -> dict[str, int]:
        """`STAT_PERIODS` and their values (read: 0 where null switched one off), as
        `trainers.Trainer.fit` and `trainers.Trainer.compile_run` take them."""
        return {key: int(getattr(self, key)) for key in STAT_PERIODS}

    def _check_run_control(self) -> None:
        """What ends, resumes, profiles or stops the run."""
        check_int(
            self.max_consecutive_nonfinite,
            "trainer.max_consecutive_nonfinite",
            0,
            ">= 0 (skipped non-finite steps in a row that are tolerated)",
        )
        if self.resume_from is not None and not self.resume_from.strip():
            raise ConfigError("trainer.resume_from='': expected a path or null.")
        if self.failed_objective is not None:
            finite_number(
                self.failed_objective,
                "trainer.failed_objective",
                "a number, the objective a failed multirun job returns, or null",
            )
        if self.profile_steps is not None:
            check_profile_steps(self.profile_steps, self.steps)
        check_stop_signals(self.stop_signals)

    def _check_evaluation(self) -> None:
        """``eval_every``, ``eval_batches``, ``eval_batch_size`` and ``objective``."""
        check_steps(
            self.eval_every,
            "trainer.eval_every",
            0,
            "a period in steps, 0 or null: at the end only",
        )
        check_int(
            self.eval_batches, "trainer.eval_batches", 0, "batches per evaluation, 0 disables"
        )
        if self.eval_batch_size is not None:
            check_int(
                self.eval_batch_size, "trainer.eval_batch_size", 1, ">= 1, or null: batch_size"
            )
        check_objective(self.objective)

    def _check_extensions(self) -> None:
        """``remat``, ``compilation_cache_dir`` and the user's ``hooks``."""
        check_remat(self.remat)
        if self.compilation_cache_dir is not None and not self.compilation_cache_dir.strip():
            raise ConfigError(
                "trainer.compilation_cache_dir='': expected a dir for JAX's compilation cache, "
                "or null to turn it off."
            )
        for i, hook in enumerate(self.hooks):
            if not isinstance(hook, dict) or not isinstance(hook.get("_target_"), str):
                raise ConfigError(
                    f"trainer.hooks[{i}]={shown(hook)}: expected a node with a _target_, e.g. "
                    "{_target_: mypkg.MyHook}."
                )


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """The ``distributed`` node: arguments of ``jax.distributed.initialize``, one process per
    host.

    Attributes:
      enabled: join a multi-process run. With the rest null, JAX detects the cluster (TPU
        pods, SLURM).
      coordinator_address: host:port of process 0.
      num_processes: the number of processes.
      process_id: this process's index.
      cpu_collectives: "gloo" joins CPU-only processes (how the tests run two hosts).
      heartbeat_timeout_s: a process silent this long is lost: the others exit 4.
      initialization_timeout_s: for every process to join, and at each start-up agreement.
    """

    enabled: bool = False
    coordinator_address: str | None = dataclasses.field(default=None, metadata=LOCATION)
    num_processes: int | None = None
    process_id: int | None = None
    cpu_collectives: str | None = None
    heartbeat_timeout_s: float = 60.0
    initialization_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        finite_positive(
            self.heartbeat_timeout_s,
            "distributed.heartbeat_timeout_s",
            "seconds without a heartbeat after which a process is lost",
        )
        finite_positive(
            self.initialization_timeout_s,
            "distributed.initialization_timeout_s",
            "seconds to wait for every process to join (and at each start-up agreement)",
        )
        if self.num_processes is not None:
            check_int(self.num_processes, "distributed.num_processes", 1, ">= 1, or null")
        if self.process_id is not None:
            top = None if self.num_processes is None else self.num_processes - 1
            allowed = "0 <= process_id < num_processes, or null"
            check_int(self.process_id, "distributed.process_id", 0, allowed, top)
        if self.cpu_collectives is not None and self.cpu_collectives not in CPU_COLLECTIVES:
            raise ConfigError(
                f"distributed.cpu_collectives={shown(self.cpu_collectives)}: choose one of "
                f"{list(CPU_COLLECTIVES)} or null."
            )
        address = self.coordinator_address
        if address is not None and (":" not in address or not address.rsplit(":", 1)[1].isdigit()):
            raise ConfigError(
                f"distributed.coordinator_address={shown(address)}: expected host:port of "
                "process 0 (e.g. 10.0.0.1:1234), or null to detect it."
            )


def check_profile_steps(value: Any, steps: int, key: str = "trainer.profile_steps") -> None:
    """Checks ``trainer.profile_steps``: ``[first, last]``, steps of the run (``1 <= first <=
    last <= trainer.steps``).

    Raises:
      ConfigError: naming `key`, the value and what is allowed.
    """
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) for s in value)
        or not 1 <= value[0] <= value[1] <= steps
    ):
        raise ConfigError(
            f"{key}={shown(value)}: expected [first, last], integers with 1 <= first <= last "
            f"<= trainer.steps={steps} (the steps to trace), or null."
        )


def finite_number(value: Any, key: str, what: str) -> float:
    """Returns `value` if it is a finite number (not a bool).

    Raises:
      ConfigError: naming `key`, the value and `what` is expected.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key}={shown(value)}: expected {what} (finite).")
    return value


def finite_positive(value: Any, key: str, what: str) -> float:
    """Returns `value` if it is a finite number > 0 (not a bool).

    Raises:
      ConfigError: naming `key`, the value and `what` it is.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{key}={shown(value)}: expected {what}, a finite number > 0.")
    return value
