"""Will the training state fit? Checked from shapes before any array is allocated.

Sizes in a config (``task.hidden=[100000000]``, ``task.vocab_size=1000000000``) used to fail
deep inside NumPy or XLA with a traceback, or get the process killed. `check_state_memory`
estimates, per device, without allocating anything (``jax.eval_shape`` of the task's init and
of the optimizer's init, laid out by the run's own shardings, ZeRO stages included):

* the params,
* the optimizer state,
* a step's gradients and its batch (its activations come on top: they are known once the
  step compiles, and `StepMemoryCheck` checks the compiled step's own memory analysis
  before it first runs),

and compares them with the memory there is: for CPU devices, which share the host's memory,
the sum over this process's devices against ``MemAvailable`` (/proc/meminfo), the room left
under the process's address-space limit (``RLIMIT_AS``) and the cgroup's memory limit; for
accelerators, each device's own free memory where the backend reports it
(``Device.memory_stats``). Everything estimated must be held at once, so a run refused here
could not have trained; one accepted may still run out (activations, XLA's buffers).

A task may declare the shapes of one example (``example_shapes()``: ``{name:
jax.ShapeDtypeStruct}``, no batch dimension), so that the check needs no data at all;
otherwise it uses the first batch.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from trainers.app.preflight import human_bytes
from trainers.core.hook import Hook
from trainers.core.zero import bytes_per_device
from xshard.errors import ConfigError
from xshard.mesh.simulated import address_space_in_use
from xshard.stats.tree import path_str

if TYPE_CHECKING:
    from trainers.tasks.base import Task


class MemoryEstimate(NamedTuple):
    """Bytes one device needs for the training state and a step (a lower bound)."""

    params: int
    opt_state: int
    grads: int  # a step's gradients (the params, as the step holds them)
    batch: int  # the device's share of a step's batch
    largest: tuple[str, tuple[int, ...], int]  # the largest parameter: path, shape, bytes

    @property
    def total(self) -> int:
        """Everything that must be held at once."""
        return self.params + self.opt_state + self.grads + self.batch

    def population(self, trials: int) -> int:
        """What `trials` trials of one population hold at once (``hydra/launcher=population``):
        each trial's state twice (stacked for the population's step, and the trial's own
        copy that its hooks read) and its gradients; one batch, shared. One trial: `total`."""
        if trials == 1:
            return self.total
        return trials * (2 * (self.params + self.opt_state) + self.grads) + self.batch


class MemoryAvailable(NamedTuple):
    """The memory the estimate must fit into: `free` bytes for `devices` devices together
    (CPU devices share the host's memory) or for each device (an accelerator's own)."""

    free: int
    devices: int
    what: str


def example_shapes(task: Task) -> dict[str, jax.ShapeDtypeStruct] | None:
    """The shapes of one example that `task` declares (``example_shapes()``), or None."""
    declare = getattr(task, "example_shapes", None)
    return dict(declare()) if callable(declare) else None


def estimate_memory(trainer: Any, batch: Mapping[str, Any], rows: int) -> MemoryEstimate:
    """Per-device bytes of `trainer`'s state and of a step on `rows` examples per device.

    Args:
      trainer: the run's `trainers.Trainer` (its task, optimizer, shardings and precision).
      batch: a batch (arrays) or its shapes (shape structs with a batch dimension).
      rows: examples per device in one step (the global batch over the data shards).
    """
    shapes = trainer.state_shapes(batch)
    sized = [
        (path_str(path), tuple(x.shape), bytes_per_device(x, s))
        for (path, x), s in zip(
            jax.tree_util.tree_flatten_with_path(shapes.params)[0],
            jax.tree.leaves(shapes.param_shardings),
            strict=True,
        )
    ]
    opt = zip(jax.tree.leaves(shapes.opt_state), jax.tree.leaves(shapes.opt_shardings), strict=True)
    grads = sum(
        bytes_per_device(x, s)
        for x, s in zip(
            jax.tree.leaves(shapes.params),
            jax.tree.leaves(trainer.layout.base_shardings(shapes.params)),
            strict=True,
        )
    )
    per_example = sum(math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize for x in batch.values())
    return MemoryEstimate(
        params=sum(b for _, _, b in sized),
        opt_state=sum(bytes_per_device(x, s) for x, s in opt),
        grads=grads,
        batch=per_example * rows,
        largest=max(sized, key=lambda leaf: leaf[2], default=("(none)", (), 0)),
    )


def available_memory(devices: Sequence[Any]) -> MemoryAvailable | None:
    """The memory `devices` (this process's) have free, or None where it cannot be known."""
    if devices[0].platform == "cpu":
        limits = [(_meminfo_available(), "available (MemAvailable)")]
        cap = resource.getrlimit(resource.RLIMIT_AS)[0]
        if cap != resource.RLIM_INFINITY:
            left = cap - address_space_in_use()
            limits.append(
                (left, f"left under its address-space limit (RLIMIT_AS {human_bytes(cap)})")
            )
        limits.append((_cgroup_free(), "free under its cgroup's memory.max"))
        known = [(n, w) for n, w in limits if n is not None]
        if not known:
            return None
        free, what = min(known)
        return MemoryAvailable(
            max(free, 0), len(devices), f"this host has {human_bytes(free)} {what}"
        )
    stats = [d.memory_stats() for d in devices]
    if not all(s and "bytes_limit" in s for s in stats):
        return None
    free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return MemoryAvailable(free, 1, f"each {devices[0].device_kind} has {human_bytes(free)} free")


def check_state_memory(
    trainer: Any,
    batch: Mapping[str, Any],
    batch_size: int,
    shards: int,
    task_node: Any,
    devices: Sequence[Any],
    trials: int = 1,
) -> MemoryEstimate:
    """Refuses a run whose state and step cannot fit in the memory of this process's devices.

    Args:
      trainer: the run's `trainers.Trainer`.
      batch: a batch or its shapes (`estimate_memory`).
      batch_size: ``trainer.batch_size``, the global batch.
      shards: the data shards it is split over.
      task_node: the ``task`` config node, to name the size that makes the largest parameter.
      devices: this process's devices.
      trials: the trials of the run's population (``hydra/launcher=population``; 1: none).

    Returns:
      The estimate (for a run that fits).

    Raises:
      ConfigError: one line naming the biggest contributor's config key and value (the
        size of the largest parameter, or ``trainer.batch_size``), the bytes of params,
        optimizer state and step, and the memory there is; for a population that fits
        only with fewer trials, ``hydra/launcher=population`` and its number of trials
        (`check_population_memory`).
    """
    estimate = estimate_memory(trainer, batch, batch_size // shards)
    have = available_memory(devices)
    if have is None or estimate.total * have.devices <= have.free:
        check_population_memory(estimate, have, trials)
        return estimate
    name, shape, size = estimate.largest
    n, show = have.devices, human_bytes
    where = f" per device, {show(estimate.total * n)} on {n} CPU devices" if n > 1 else ""
    parts = (
        f"the params need {show(estimate.params)} (the largest: {name} {list(shape)} "
        f"{show(size)}), the optimizer state {show(estimate.opt_state)}, a step at least "
        f"{show(estimate.grads + estimate.batch)} (gradients and batch){where}; {have.what}."
    )
    if estimate.batch > estimate.params:  # the batch is the largest part
        raise ConfigError(
            f"trainer.batch_size={batch_size} needs {show(estimate.batch * n)} for one step's "
            f"batch: {parts} Choose a smaller trainer.batch_size."
        )
    raise ConfigError(
        f"{size_key(task_node, shape)}: {parts} Choose smaller sizes, or shard the state "
        "(sharding.zero_stage, a model axis) over more devices."
    )


def size_key(task_node: Any, shape: Sequence[int]) -> str:
    """``task.<key>=<value>``: the task's config key whose value (or an item of it) is the
    largest dimension of `shape` (else another of its dimensions); ``task`` if none is."""
    from omegaconf import OmegaConf

    node = (
        OmegaConf.to_container(task_node, resolve=True)
        if OmegaConf.is_config(task_node)
        else task_node
    )
    found = dict(_int_keys(node, "task"))
    for dim in sorted(shape, reverse=True):
        for key, value in found.items():
            if dim in (value if isinstance(value, list) else [value]):
                return f"{key}={value}"
    return f"task={node.get('name', '?')}" if isinstance(node, dict) else "task"


def _int_keys(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """``(key, value)`` of every integer or list of integers under `node`."""
    if isinstance(node, dict):
        return [kv for k, v in node.items() for kv in _int_keys(v, f"{prefix}.{k}")]
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    if is_int(node) or (isinstance(node, list) and node and all(is_int(v) for v in node)):
        return [(prefix, node)]
    return []


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_population_memory(
    estimate: MemoryEstimate, have: MemoryAvailable | None, trials: int
) -> None:
    """Refuses a population of `trials` trials whose states do not fit in `have` together
    (`MemoryEstimate.population`), one trial's having fitted: before anything is compiled.

    Raises:
      ConfigError: naming ``hydra/launcher=population``, the number of trials, the bytes
        they need and the memory there is, and how many trials would fit.
    """
    n = 1 if have is None else have.devices
    if have is None or estimate.population(trials) * n <= have.free:
        return
    fit = max(t for t in range(1, trials) if estimate.population(t) * n <= have.free)
    show = human_bytes
    where = f", {show(estimate.population(trials) * n)} on {n} CPU devices" if n > 1 else ""
    raise ConfigError(
        f"hydra/launcher=population: {trials} trials need {show(estimate.population(trials))} "
        f"per device ({show(estimate.params + estimate.opt_state)} of params and optimizer "
        f"state a trial, held twice: stacked for the population's step and each trial's own)"
        f"{where}; {have.what}. At most {fit} {'trial fits' if fit == 1 else 'trials fit'}: "
        "sweep fewer values at once (Optuna: hydra.sweeper.n_jobs), or use Hydra's basic "
        "launcher (hydra/launcher=basic)."
    )


def _cgroup_free() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2), or None if unlimited."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            return int(limit) - int(f.read().strip())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ a step's compiled program


class StepMemory(NamedTuple):
    """Bytes one device holds while a compiled step runs (XLA's memory analysis)."""

    arguments: int  # the state and the batch going in
    outputs: int  # the new state and the metrics (less what reuses donated inputs)
    temporaries: int  # the step's activations and XLA's scratch buffers

    @property
    def total(self) -> int:
        """Everything held at the step's peak."""
        return self.arguments + self.outputs + self.temporaries


def step_memory(programs: Mapping[int, Any]) -> StepMemory | None:
    """The largest of the compiled step `programs`' per-device memory (by total); None where
    the backend gives no memory analysis."""
    found = []
    for compiled in programs.values():
        stats = compiled.memory_analysis()
        if stats is None:
            continue
        outputs = max(stats.output_size_in_bytes - stats.alias_size_in_bytes, 0)
        found.append(StepMemory(stats.argument_size_in_bytes, outputs, stats.temp_size_in_bytes))
    return max(found, key=lambda m: m.total, default=None)


def check_step_memory(
    programs: Mapping[int, Any], have: MemoryAvailable | None, batch_size: int
) -> StepMemory | None:
    """Refuses a run whose compiled step needs more memory than `have`: the state fitted
    (`check_state_memory`), so what is too large is the step's activations.

    Raises:
      ConfigError: naming ``trainer.batch_size``, the step's bytes per device and in all, and
        the memory there is.
    """
    need = step_memory(programs)
    if need is None or have is None or need.total * have.devices <= have.free:
        return need
    show, n = human_bytes, have.devices
    where = f", {show(need.total * n)} on {n} CPU devices" if n > 1 else ""
    raise ConfigError(
        f"trainer.batch_size={batch_size}: a compiled step needs {show(need.total)} per device "
        f"(its activations and buffers {show(need.temporaries)}, state and batch in "
        f"{show(need.arguments)}, out {show(need.outputs)}){where}; {have.what}. Choose a "
        "smaller trainer.batch_size, trainer.microbatches > 1 or trainer.remat=full."
    )


class StepMemoryCheck(Hook):
    """Runs `check_step_memory` on the programs `Trainer.fit` compiled before its first step,
    on every process at once (`agreed`: a refusal on one process stops all)."""

    def __init__(
        self, devices: Sequence[Any], batch_size: int, agreed: Callable[[str], Any]
    ) -> None:
        self._devices = devices
        self._batch_size = batch_size
        self._agreed = agreed

    def on_compiled(self, programs: Mapping[int, Any]) -> None:
        with self._agreed("checking the memory of the compiled step"):
            check_step_memory(programs, available_memory(self._devices), self._batch_size)
