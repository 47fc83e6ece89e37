"""A delayed sync overlapped with the inner steps it waits for (``overlap``): ONE program.

With ``sync_delay`` tau > 0 a fragment sends its pseudo-gradient at step t
(``OuterState.pending``) and its outer update follows step t + tau. The separate form runs the
tau inner steps and then the sync program (`trainers.core.periodic.sync`); the *window*
program runs them in one compiled program: the inner step under ``lax.scan`` over the tau
batches, the reduction of what was sent, the outer optimizer and the mixing after them.

What makes it overlappable is what the program does not connect: the scan's carry leaves the
outer state out, so the collective over the periodic axis reads only the program's inputs
(``pending``, the residual) and the scan reads nothing the collective wrote. A latency-hiding
scheduler (XLA's on GPU and TPU) can then start the all-reduce, run the loop and wait for
it at the outer update; `collective_after_loop` reads that independence back from the
compiled program's text. XLA:CPU runs the two one after the other
(`benchmarks/overlap_probe.py`, docs/reductions.md): on CPU the window is the same arithmetic
in fewer dispatches, not faster.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainers.core.step.types import TrainState
from xshard.reduce.periodic import due_fragment


class WindowParts(NamedTuple):
    """What a window program takes from the step programs
    (`trainers.core.step.programs.StepPrograms`)."""

    step: Callable[..., Any]  # ``StepPrograms.step_program`` of the plain step
    extra: tuple[Any, ...]  # its inputs after the state and batch (``extra_inputs``)
    extra_shardings: tuple[Any, ...]
    batch_sharding: Any
    state_shardings: Any


def window_program(
    step: Callable[..., Any],
    sync: Callable[[TrainState, Any], tuple[TrainState, jax.Array]],
    batch_sharding: Any,
) -> Callable[..., Any]:
    """The window program: ``(state, batches, hyperparams, *votes) -> (state, metrics rows of
    each step, the sync's statistics vector)``.

    Args:
      step: a step program ``(state, batch, hyperparams, *votes) -> (state, metrics rows)``
        (`trainers.core.step.programs.StepPrograms.step_program`).
      sync: ``(state, hyperparams) -> (state, statistics)``: the fragment's sync program
        (`trainers.core.periodic.axis.Periodic.sync` with the outer optimizer on the inputs).
      batch_sharding: a global batch's sharding (each scanned batch is constrained to it).
    """

    def program(state: TrainState, batches: tuple[Any, ...], hyperparams: Any, *votes: Any):
        outer = state.outer

        def body(carry, batch):
            batch = jax.lax.with_sharding_constraint(batch, batch_sharding)
            return step(carry, batch, hyperparams, *votes)

        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
        # The outer state stays out of the loop: the collective reads only the inputs.
        after, values = jax.lax.scan(body, state._replace(outer=None), stacked)
        new_state, stats = sync(after._replace(outer=outer), hyperparams)
        return new_state, values, stats

    return program


class Independence(NamedTuple):
    """What the compiled text of a window program says: its collectives over the periodic
    axis, the loop, and whether any collective reads the loop's results or the loop reads a
    collective's."""

    collectives: tuple[str, ...]  # the instruction names of the all-reduces / all-to-alls
    loop: str  # the while loop's instruction name
    collective_reads_loop: bool
    loop_reads_collective: bool


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_OP = re.compile(r"[\]})]\s+([a-z][\w\-]*)\(([^)]*)\)(.*)$")  # after the result's type
_COLLECTIVES = ("all-reduce", "all-reduce-start", "all-to-all", "all-gather", "collective-permute")


def _entry(text: str) -> list[str]:
    """The lines of the compiled module's ENTRY computation."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    return lines[start + 1 : end]


def independence(text: str, replica_groups: str) -> Independence:
    """Reads `text` (a compiled window program's ``as_text()``): the ENTRY computation's
    collectives whose replica groups are `replica_groups` (the periodic axis's), its while
    loop, and the data flow between them (operands followed back through the ENTRY's
    instructions; the loop's body is its own computation)."""
    operands: dict[str, list[str]] = {}
    ops: dict[str, str] = {}
    groups: dict[str, str] = {}
    for line in _entry(text):
        m = _NAME.match(line)
        op = None if m is None else _OP.search(m.group(2))
        if m is None or op is None:
            continue
        name = m.group(1)
        # XLA:CPU wraps a small loop in a call of its computation (``xla_cpu_small_call``).
        ops[name] = "while" if "to_apply=%while" in op.group(3) else op.group(1)
        operands[name] = [x.lstrip("%") for x in re.findall(r"%[\w.\-]+", op.group(2))]
        g = re.search(r"replica_groups=(\{[\d,{}]*\})", op.group(3))
        groups[name] = g.group(1) if g else ""

    def reads(name: str) -> set[str]:
        seen, todo = set(), list(operands.get(name, []))
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += operands.get(x, [])
        return seen

    (loop,) = [n for n, op in ops.items() if op == "while"]
    collectives = tuple(
        n for n, op in ops.items() if op in _COLLECTIVES and groups[n] == replica_groups
    )
    return Independence(
        collectives,
        loop,
        any(loop in reads(c) for c in collectives),
        any(c in reads(loop) for c in collectives),
    )


def overlapped_steps(
    trainer: Any, state: TrainState, step: int, batches: list[Any], stop_vote: int = 0
) -> tuple[TrainState, list[Any]]:
    """Updates ``step + 1 .. step + sync_delay`` of `trainer` (a `trainers.Trainer` with a
    periodic axis) on `batches` (host-local or global) and the outer update of the fragment
    sent after update `step`, in ONE window program: the state, and each update's
    `trainers.core.metrics.StepMetrics` (the last with the sync's statistics and the bytes
    sent, as ``Trainer.sync`` gives them). Donates `state`.

    Raises:
      ValueError: as `trainers.core.periodic.sync.PeriodicPrograms.window`.
    """
    from trainers.core.periodic.axis import BYTES_TAG
    from trainers.core.step.compiled import ProgramKey
    from trainers.core.step.levels import PLAIN

    programs, periodic = trainer.programs, trainer.periodic_programs
    placed = tuple(trainer.placement.as_global(b) for b in batches)
    key = ProgramKey(PLAIN)
    programs.compile_missing([key], state, placed[0])  # the metric names
    extra, extra_shardings = programs.extra_inputs(stop_vote)
    parts = WindowParts(
        programs.step_program(key, []),
        extra,
        extra_shardings,
        trainer.placement.batch_sharding,
        trainer.state_shardings(state),
    )
    state, values, stats, _ = periodic.window(state, step, placed, parts)
    metrics = [programs.compiled.metrics(PLAIN, values[i]) for i in range(len(placed))]
    fragment = due_fragment(step, periodic.periodic.rule)
    sent = {BYTES_TAG.format(axis=periodic.periodic.axis): periodic.bytes_per_step}
    last = metrics[-1].with_device_values(periodic.periodic.sync_keys(fragment), stats)
    metrics[-1] = last.with_host_values(**sent)
    return state, metrics
