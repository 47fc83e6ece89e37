"""What every variant trains: the task, its config, the optimizer, the mesh and the batches.

The config is composed from the project's own Hydra configs (``pkg://xshard.conf``), exactly as
``python -m trainers.train task=<task> optimizer=adam schedule=constant reduction=mean`` would
compose it, so the xshard variants use the optimizer that the CLI would build and the
hand-written variants use the same optax optimizer with the same hyperparameters.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import hydra
import jax
import numpy as np
import optax
from hydra import compose, initialize_config_module
from jax.sharding import Mesh
from omegaconf import DictConfig, OmegaConf

from xshard.mesh.build import build_mesh
from xshard.optim.factory import build_optimizer

#: Workload name -> (the ``task`` group option, its overrides). `gpt_8x256` is tiny_gpt at
#: 8 layers x 256 wide (6.3M params), where the state, not the per-kernel overhead, dominates;
#: its global batch is 16 (2 sequences per shard) so that a step takes about a second on the
#: 8 simulated CPU devices of a 2-core machine.
#: `gpt_4x128` is tiny_gpt at 4 layers x 128 wide, between the two (issue 38's third workload).
GPT_8X256 = ("task.n_layers=8", "task.d_model=256", "task.d_ff=1024", "task.n_heads=8")
GPT_4X128 = ("task.n_layers=4", "task.d_model=128", "task.d_ff=512")
WORKLOADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp": ("mlp", ()),
    "tiny_gpt": ("tiny_gpt", ()),
    "gpt_4x128": ("tiny_gpt", GPT_4X128),
    "gpt_8x256": ("tiny_gpt", (*GPT_8X256, "trainer.batch_size=16")),
}
TASKS = tuple(WORKLOADS)
#: The workloads of the sections that build many programs per workload (one per device
#: count): the two small ones.
SMALL_TASKS = ("mlp", "tiny_gpt")

#: Optimizer, schedule and reduction of every benchmark: adam, constant rate, MEAN.
OPTIMIZER_OVERRIDES = ("optimizer=adam", "schedule=constant", "reduction=mean", "clip=null")

#: `--smoke` shrinks the transformer so that its compilations take a second, not ten.
SMOKE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "mlp": ("trainer.batch_size=16",),
    "tiny_gpt": (
        "trainer.batch_size=16",
        "task.d_model=32",
        "task.n_heads=2",
        "task.n_layers=1",
        "task.d_ff=64",
        "task.seq_len=16",
    ),
}
SMOKE_OVERRIDES["gpt_8x256"] = SMOKE_OVERRIDES["gpt_4x128"] = SMOKE_OVERRIDES["tiny_gpt"]

DATA_AXIS = "data"

#: The optimizers the optimizer benchmarks compare, each with the overrides a user must type to
#: train with it (``python -m trainers.train <overrides>``; docs/config.md): schedule-free AdamW
#: refuses the default decaying schedule. adamw, the CLI's default, first: the baseline.
CLI_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "adamw": ("optimizer=adamw",),
    "muon": ("optimizer=muon",),
    "schedule_free_adamw": ("optimizer=schedule_free_adamw", "schedule=constant"),
    "adopt": ("optimizer=adopt",),
}


def compose_config(task: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The trainer's primary config ``xshard_train`` for `task` with the benchmark optimizer."""
    with initialize_config_module(config_module="xshard.conf", version_base="1.3"):
        return compose("xshard_train", overrides=[f"task={task}", *OPTIMIZER_OVERRIDES, *overrides])


def make_mesh(num_devices: int) -> Mesh:
    """A 1-D data-parallel mesh over the first `num_devices` devices, via `xshard.build_mesh`."""
    devices = jax.devices()[:num_devices]
    if len(devices) != num_devices:
        raise ValueError(f"asked for {num_devices} devices, {len(jax.devices())} present")
    cfg = {
        "name": f"bench{num_devices}",
        "num_devices": num_devices,
        "axes": [DATA_AXIS],
        "ici": [-1],
        "dcn": [1],
        "axis_types": "auto",
        "simulate_on_cpu": False,
        "data_axes": [DATA_AXIS],
    }
    return build_mesh(cfg, devices=devices)


def device_counts(limit: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the number of devices present (or `limit`)."""
    n = len(jax.devices()) if limit is None else min(limit, len(jax.devices()))
    return [2**i for i in range(n.bit_length()) if 2**i <= n]


@dataclasses.dataclass
class Workload:
    """One task with its composed config and a fixed set of host batches.

    Attributes:
      name: the task group option ("mlp" or "tiny_gpt").
      cfg: the composed config.
      task: the instantiated task.
      global_batch_size: examples per step over all shards (``trainer.batch_size``).
      host_batches: a few global batches as NumPy arrays, cycled by every variant, so that
        no variant pays for data generation inside the timed loop.
    """

    name: str
    cfg: DictConfig
    task: Any
    global_batch_size: int
    host_batches: list[dict[str, np.ndarray]]

    def xshard_optimizer(self, mesh: Mesh) -> optax.GradientTransformation:
        """The cross-shard optimizer the CLI builds from this config (`build_optimizer`)."""
        return build_optimizer(self.cfg, mesh=mesh)

    def plain_optimizer(self) -> optax.GradientTransformation:
        """The same optax optimizer, unwrapped: ``optax.adam(learning_rate=..., ...)``."""
        return hydra.utils.instantiate(self.cfg.optimizer, _convert_="all")

    def model_config(self) -> dict[str, Any]:
        """The task node and batch size, for the report."""
        node = OmegaConf.to_container(self.cfg.task, resolve=True)
        node.pop("_target_", None)
        return {"task": node, "global_batch_size": self.global_batch_size}


def make_workload(name: str, *, smoke: bool, num_batches: int = 4) -> Workload:
    """Composes the config of workload `name` (`WORKLOADS`), instantiates its task and draws
    `num_batches` batches."""
    task_option, overrides = WORKLOADS[name]
    cfg = compose_config(task_option, (*overrides, *(SMOKE_OVERRIDES[name] if smoke else ())))
    return _workload(name, cfg, num_batches)


def cli_workload(
    name: str, overrides: Sequence[str], *, smoke: bool, num_batches: int = 4
) -> Workload:
    """Workload `name` as ``python -m trainers.train`` composes it with only `overrides`: the
    CLI's own optimizer, schedule, reduction and clip, not the benchmark's (`compose_config`)."""
    task_option, task_overrides = WORKLOADS[name]
    smoke_overrides = SMOKE_OVERRIDES[name] if smoke else ()
    with initialize_config_module(config_module="xshard.conf", version_base="1.3"):
        cfg = compose(
            "xshard_train",
            overrides=[f"task={task_option}", *task_overrides, *overrides, *smoke_overrides],
        )
    return _workload(name, cfg, num_batches)


def _workload(name: str, cfg: DictConfig, num_batches: int) -> Workload:
    """The `Workload` of the composed `cfg`: its task and `num_batches` batches."""
    task = hydra.utils.instantiate(cfg.task, _convert_="all")
    batch_size = int(cfg.trainer.batch_size)
    batches = list(itertools.islice(task.batches(batch_size, seed=int(cfg.seed)), num_batches))
    return Workload(name, cfg, task, batch_size, batches)
