"""Which gradient path is faster here: a short race of compiled plain steps at start-up.

``trainer.grad_impl=auto`` (`trainers.app.grad_path`) hands this module a `Trainer` per path
that can run (same task, optimizer, mesh and placement; only ``grad_impl`` differs). `race`
compiles each one's plain program (the one that runs most steps; a path whose program the
config refuses, per-shard clipping on ``gspmd`` for one, is left out with its reason), then
times plain steps of each on ONE copy of the state, which the paths take turns to update and
which is dropped afterwards: the run's own state never takes a timed step, so training is
the same whichever path wins. Blocks of steps of the two paths alternate A B / B A (load
changes hit both alike) and the first block of each is a warm-up; the median ms/step per
path decides, a tie keeps the first path. What the race costs is bounded by `RACE_SECONDS`
of timed steps (besides compiling the other path's plain program) and reported in
`RaceResult.seconds`. `race_key` names what a race decides (the paths' plain programs and
the machine that runs them), so that the app can remember the choice for the next run of the
same programs (`trainers.app.race_memory`).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainers.core.step.levels import PLAIN
from trainers.core.trainer import Trainer, TrainState
from xshard.errors import ConfigError

#: Seconds of timed steps the race may take in all (both paths; the warm-up block included).
RACE_SECONDS = 2.0
#: Timed blocks per path after the warm-up step (fewer, down to 2, if the budget is short);
#: steps per block are at most `MAX_BLOCK` (steps in flight are bounded: XLA:CPU's
#: collectives deadlock with dozens queued).
RACE_ROUNDS = 4
MAX_BLOCK = 8


class RaceResult(NamedTuple):
    """What the race found.

    Attributes:
      chosen: the path the run keeps.
      ms_per_step: the median ms per plain step of each path timed (empty if only one ran).
      refused: the paths left out, each with the one-line reason its program gave.
      seconds: the race's wall time: compiling every path's plain program (and the first
        path's other programs, `race`'s ``ahead``) and the timed steps.
      steps_per_block: plain steps in each timed block (0 if nothing was timed), in
        `RACE_ROUNDS` blocks per path or fewer.
    """

    chosen: str
    ms_per_step: dict[str, float]
    refused: dict[str, str]
    seconds: float
    steps_per_block: int


def race(
    trainers: Mapping[str, Trainer],
    state: TrainState,
    batch: Any,
    agree: Callable[[str, Any], Any] = lambda name, value: value,
    check: Callable[[Mapping[int, Any]], None] = lambda programs: None,
    ahead: Callable[[Trainer], None] = lambda trainer: None,
) -> RaceResult:
    """Compiles each trainer's plain program and, when more than one compiles, times them.

    Args:
      trainers: a `Trainer` per path, in order of preference (a tie keeps the first).
      state: the run's state (not modified, not donated).
      batch: a batch of the run (host-local or global).
      agree: ``agree(name, value)`` -> the lead process's `value` on every process (the
        number of steps per block, the choice): every process must take the same steps.
      check: called once with every compiled path's programs (`Trainer.executables`, keyed
        by their order) before any step runs, as `trainers.core.hook.Hook.on_compiled` is
        before the run's first step (the app's memory check: a step too large for the memory
        is refused, not run).
      ahead: called with the first path's trainer after its plain program compiled, in the
        same thread, while the other paths' plain programs compile: the run's other programs
        of that path (``Trainer.compile_run``). The first path is the one a tie keeps, and
        the usual winner; its other programs then fill the cores while the other path's
        plain program compiles, where they would compile after the race (wasted, CPU time
        only, if another path wins).

    Returns:
      The `RaceResult`.

    Raises:
      ConfigError: the first path's error if no path's program compiles, or `check`'s.
    """
    start = time.perf_counter()
    ready, refused = {}, {}
    # Concurrently, as `Trainer.compile_run` compiles a path's levels (XLA compiles without
    # the GIL).
    first = next(iter(trainers))

    def compile_path(name: str, trainer: Trainer) -> None:
        trainer.compile_levels(state, batch, [0])
        if name == first:
            ahead(trainer)

    with ThreadPoolExecutor(len(trainers), thread_name_prefix="xshard-race") as pool:
        futures = {name: pool.submit(compile_path, name, t) for name, t in trainers.items()}
    for name, future in futures.items():
        try:
            future.result()
            ready[name] = trainers[name]
        except ConfigError as e:
            refused[name] = str(e)
    if not ready:
        raise ConfigError(next(iter(refused.values())))
    if len(ready) == 1:
        return RaceResult(next(iter(ready)), {}, refused, time.perf_counter() - start, 0)
    compiled = [p for trainer in ready.values() for p in trainer.executables().values()]
    check(dict(enumerate(compiled)))  # once: on several processes each call is a collective
    ms, block = _time_paths(ready, state, batch, agree)
    chosen = agree("grad_impl_race", min(ms, key=ms.__getitem__))  # a tie: the first
    return RaceResult(chosen, ms, refused, time.perf_counter() - start, block)


def _time_paths(
    trainers: Mapping[str, Trainer],
    state: TrainState,
    batch: Any,
    agree: Callable[[str, Any], Any],
) -> tuple[dict[str, float], int]:
    """Median ms per plain step of each trainer, on one copy of `state`, and the block size."""
    first = next(iter(trainers.values()))
    batch = first.placement.as_global(batch)
    copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=first.state_shardings(state))
    scratch = copy(state)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    order = list(trainers)
    for _ in range(2):  # warm-up; the second pass, without first runs' set-up, sizes blocks
        warm = 0.0  # a step of each path
        for name in order:
            began = time.perf_counter()
            scratch, _ = trainers[name].step(scratch, batch, with_stats=False)
            jax.block_until_ready(scratch)
            warm += time.perf_counter() - began
    # Steps of each path the budget leaves, in RACE_ROUNDS blocks (at least 2 of 1 step).
    budget = int((RACE_SECONDS - 2 * warm) / max(warm, 1e-6))
    rounds = int(agree("grad_impl_rounds", max(2, min(RACE_ROUNDS, budget))))
    block = int(agree("grad_impl_block", max(1, min(MAX_BLOCK, budget // rounds))))
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:
            began = time.perf_counter()
            for _ in range(block):
                scratch, _ = trainers[name].step(scratch, batch, with_stats=False)
            jax.block_until_ready(scratch)
            times[name].append((time.perf_counter() - began) * 1e3 / block)
    del scratch
    return {name: statistics.median(t) for name, t in times.items()}, block


def race_key(trainers: Mapping[str, Trainer], state: TrainState, batch: Any) -> str | None:
    """A digest of what a race between `trainers` decides: each path's plain program (its
    StableHLO, lowered for `state` and batches like `batch`, not compiled) and what runs it
    (JAX's version, the platform, the kind and number of devices, the processes and the
    host's CPUs). Runs that lower the same programs on the same kind of machine get the same
    key: every rerun of a config, and the jobs of a sweep that differ only in
    hyperparameters (inputs of the programs). None if a path's program is refused (the race
    leaves it out, with its reason).
    """
    digest = hashlib.sha256()
    try:
        for name, trainer in trainers.items():
            text = trainer.lower(PLAIN, state, trainer.placement.as_global(batch)).as_text()
            digest.update(f"{name}\0{hashlib.sha256(text.encode()).hexdigest()}\0".encode())
    except ConfigError:
        return None
    device = jax.devices()[0]
    machine = (
        jax.__version__,
        device.platform,
        device.device_kind,
        jax.device_count(),
        jax.process_count(),
        os.cpu_count(),
    )
    digest.update(repr(machine).encode())
    return digest.hexdigest()
