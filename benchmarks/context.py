"""The run's shared state: settings, and every workload, mesh and step loop built once.

Sections ask the `Bench` for what they need; whatever another section already built (and
compiled) is reused, so a step is compiled once per process, and its first-call record is the
true cold compilation (not a hit in JAX's in-memory caches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from benchmarks import variants
from benchmarks.timing import Plan
from benchmarks.variants import StepLoop
from benchmarks.workloads import TASKS, Workload, make_mesh, make_workload
from trainers.core.step import HISTOGRAMS, LAYERS, PLAIN, STATS
from trainers.core.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much to run. `smoke`: tiny models and step counts, to catch rot, not to measure."""

    smoke: bool = False
    #: The workloads the sections run (``--tasks``; `benchmarks.workloads.TASKS` by default).
    tasks: tuple[str, ...] = TASKS

    def plan(self, task: str, kind: str = "step") -> Plan:
        """Warm-up, rounds and steps per block for `task` ("mlp" is ~100x cheaper)."""
        if self.smoke:
            return Plan(warmup_blocks=1, rounds=2, steps_per_block=2)
        if kind == "host":
            return Plan(warmup_blocks=2, rounds=20, steps_per_block=20)
        if kind == "scaling":
            return Plan(2, 20, 10) if task == "mlp" else Plan(1, 10, 2)
        if task == "gpt_8x256":  # ~1 s per step
            return Plan(1, 10, 1)
        return Plan(2, 40, 10) if task == "mlp" else Plan(1, 20, 3)

    def device_counts(self, available: list[int]) -> list[int]:
        """Device counts of the scaling section: all of `available`; smoke: the extremes."""
        return sorted({available[0], available[-1]}) if self.smoke else available

    @property
    def compile_check_steps(self) -> int:
        """Steps run after the first one while counting compilations."""
        return 4 if self.smoke else 20


class Bench:
    """Builds and caches workloads, meshes, trainers and step loops."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._workloads: dict[str, Workload] = {}
        self._meshes: dict[int, Mesh] = {}
        self._params: dict[str, Any] = {}
        self._trainers: dict[tuple[str, int, str, str], Trainer] = {}
        self._loops: dict[tuple[str, str, int], StepLoop] = {}
        self._memo: dict[Any, Any] = {}

    @property
    def max_devices(self) -> int:
        """Devices of the main mesh: 8 simulated CPU devices, or every accelerator."""
        return len(jax.devices())

    def workload(self, task: str) -> Workload:
        if task not in self._workloads:
            self._workloads[task] = make_workload(task, smoke=self.settings.smoke)
        return self._workloads[task]

    def mesh(self, n: int | None = None) -> Mesh:
        n = self.max_devices if n is None else n
        if n not in self._meshes:
            self._meshes[n] = make_mesh(n)
        return self._meshes[n]

    def trainer(
        self,
        task: str,
        n: int | None = None,
        grad_impl: str = "manual",
    ) -> Trainer:
        n = self.max_devices if n is None else n
        key = (task, n, grad_impl)
        if key not in self._trainers:
            self._trainers[key] = variants.make_trainer(
                self.workload(task), self.mesh(n), grad_impl
            )
        return self._trainers[key]

    def initial_params(self, task: str) -> Any:
        """The trainer's seed-derived initial params, as host arrays (every variant's start)."""
        if task not in self._params:
            trainer = self.trainer(task)
            params = trainer.init_params(self.workload(task).host_batches[0])
            self._params[task] = jax.device_get(params)
        return self._params[task]

    def loop(self, task: str, name: str, n: int | None = None) -> StepLoop:
        """The step loop of variant `name` (see `benchmarks.variants`) on `n` devices."""
        n = self.max_devices if n is None else n
        key = (task, name, n)
        if key not in self._loops:
            self._loops[key] = self._build(task, name, n)
        return self._loops[key]

    def _build(self, task: str, name: str, n: int) -> StepLoop:
        wl, params, mesh = self.workload(task), self.initial_params(task), self.mesh(n)
        if name == "xshard_trainer":
            return variants.trainer_loop(name, wl, self.trainer(task, n), params)
        if name == "xshard_trainer_stats10":
            every10 = lambda i: STATS if i % 10 == 0 else PLAIN
            return variants.trainer_loop(name, wl, self.trainer(task, n), params, every10)
        if name == "xshard_trainer_gspmd":
            return variants.trainer_loop(name, wl, self.trainer(task, n, "gspmd"), params)
        if name == "xshard_trainer_gspmd_stats10":
            every10 = lambda i: STATS if i % 10 == 0 else PLAIN
            return variants.trainer_loop(name, wl, self.trainer(task, n, "gspmd"), params, every10)
        if name.startswith("xshard_trainer+"):
            level = {"layer_stats": LAYERS, "histograms": HISTOGRAMS}[name.split("+", 1)[1]]
            return variants.trainer_loop(name, wl, self.trainer(task, n), params, level)
        if name in ("xshard_nostats", "xshard_guard"):
            return variants.shard_map_loop(name, wl, mesh, params, guard=name == "xshard_guard")
        if name == "jit_gspmd":
            return variants.jit_loop(wl, mesh, params)
        if name == "pmap_pmean":
            return variants.pmap_loop(wl, list(mesh.devices.flat), params)
        raise ValueError(f"unknown variant {name!r}")

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()` once per `key` (e.g. a timing group that two sections report on)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def built_loops(self) -> dict[tuple[str, str, int], StepLoop]:
        """Every loop built so far, by (task, variant, devices)."""
        return dict(self._loops)
