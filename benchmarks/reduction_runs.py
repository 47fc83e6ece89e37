"""Runs of one reduction preset (or optimizer), built from the project's Hydra configs as the CLI
builds them, and their quality over seeds.

`Run` composes ``python -m trainers.train task=tiny_gpt mesh=cpu2x4_slices reduction=<preset>
<overrides>`` (another base than `BASE_OVERRIDES` where given), builds the task, optimizer and
`trainers.Trainer` with `trainers.app.builders.build_run` (the code path of the CLI) and steps
it as ``Trainer.fit`` does: each update, then ``Trainer.sync`` (the periodic axis's sync when
due). Only the plain step program is used (no statistics), so each run compiles its inner
program and, with a periodic axis, its sync program, nothing else. Every step waits for its
loss: at most one step in flight (XLA:CPU collectives deadlock with many queued).

The step-time loops (`InnerLoop`, `SyncLoop`) drive the two programs of a run separately for
`benchmarks.timing.interleave`. `train_variants` trains named variants over seeds and gives
the spread of their final training and eval losses (`benchmarks.reductions`,
`benchmarks.optimizer_quality`).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

#: The composition every run starts from; a variant adds its own overrides.
BASE_OVERRIDES: tuple[str, ...] = ("task=tiny_gpt", "mesh=cpu2x4_slices")
#: --smoke: a one-layer, 32-wide tiny_gpt on short windows.
SMOKE_OVERRIDES: tuple[str, ...] = (
    "task.n_layers=1",
    "task.d_model=32",
    "task.d_ff=64",
    "task.seq_len=16",
)


def compose_config(overrides: Sequence[str], base: Sequence[str] = BASE_OVERRIDES) -> Any:
    """The composed ``xshard_train`` config with `base` and `overrides` (later ones win).
    ``paths.output_dir`` points at a temporary dir: nothing is written there."""
    from hydra import compose, initialize_config_module

    out = tempfile.gettempdir()
    with initialize_config_module("xshard.conf", version_base="1.3"):
        return compose("xshard_train", overrides=[*base, f"paths.output_dir={out}", *overrides])


class Run:
    """A trainer built from `overrides` and its state, stepped as ``Trainer.fit`` steps.

    Args:
      overrides: Hydra overrides after `base` (``reduction=diloco``, ``seed=1``...).
      base: the overrides every run of a benchmark starts from.

    Attributes:
      cfg: the composed config.
      trainer: the `trainers.Trainer`.
      state: the current `TrainState`.
      step: updates done.
      losses: the training loss of every update (the mean over replicas).
      seconds: the wall seconds of every update (sync included), each waited for.
    """

    def __init__(self, overrides: Sequence[str], base: Sequence[str] = BASE_OVERRIDES):
        from trainers.app.builders import build_run, read_options
        from xshard.mesh.build import build_mesh
        from xshard.mesh.spec import data_axes

        self.cfg = compose_config(overrides, base)
        self.options = read_options(self.cfg)
        self.mesh = build_mesh(self.cfg.mesh)
        self.data_axes = data_axes(self.cfg.mesh)
        parts = build_run(self.cfg, self.options, self.mesh, self.data_axes)
        self.task, self.trainer = parts.task, parts.trainer
        self.batches = self._batches()
        self.state = self.trainer.init(*self.trainer.init_variables(next(self._batches())))
        self.step = 0
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.last_metrics: Any = None

    def _batches(self) -> Iterator[Any]:
        opts = self.options.trainer
        return iter(self.task.batches(opts.batch_size, seed=self.options.seed))

    @property
    def every_steps(self) -> int:
        """H: steps between syncs of the periodic axis (1 without one)."""
        periodic = self.trainer.periodic
        return 1 if periodic is None else periodic.rule.every_steps

    def train(self, steps: int) -> None:
        """`steps` updates, each followed by the sync when one is due."""
        for _ in range(steps):
            self.step += 1
            start = time.perf_counter()
            state, metrics = self.trainer.step(self.state, next(self.batches), with_stats=False)
            self.state, self.last_metrics = self.trainer.sync(state, self.step, metrics)
            self.losses.append(float(self.last_metrics["train/loss"]))  # waits: one in flight
            self.seconds.append(time.perf_counter() - start)

    def force_sync(self) -> None:
        """Runs the sync program of fragment 0 now (compiling it first), whatever the step:
        its numbers are not those of a run, its program is."""
        every = self.every_steps
        self.state, self.last_metrics = self.trainer.sync(self.state, every, self.last_metrics)
        jax.block_until_ready(self.state)

    def programs(self) -> dict[str, Any]:
        """The compiled programs run so far: ``inner`` (the plain step) and, with a periodic
        axis, ``sync`` (fragment 0's)."""
        out = {"inner": self.trainer.executable_for(0)}
        if self.trainer.periodic is not None:
            out["sync"] = self.trainer.sync_executable(0)
        return {k: v for k, v in out.items() if v is not None}

    def evaluate(self) -> dict[str, float]:
        """The task's evaluation (``trainer.eval_batches`` batches) of the outer params."""
        from trainers.hooks.evaluation import build_evaluator

        evaluator = build_evaluator(
            self.task,
            self.mesh,
            self.state,
            data_axes=self.data_axes,
            opts=self.options.trainer,
            seed=self.options.seed,
        )
        assert evaluator is not None, "tiny_gpt has an eval split"
        return evaluator.evaluate(self.state)


@dataclasses.dataclass(frozen=True)
class Quality:
    """One run's result: the final training loss (mean of the last `tail` updates, over
    replicas), the eval loss of the final (outer) params and the median wall milliseconds of
    an update after the first (which compiles)."""

    seed: int
    train_loss: float
    eval_loss: float
    tail: int
    step_ms: float


def train_and_evaluate(
    overrides: Sequence[str],
    steps: int,
    seed: int,
    tail: int,
    base: Sequence[str] = BASE_OVERRIDES,
) -> Quality:
    """Trains a fresh `Run` of `overrides` with ``seed=<seed>`` for `steps` updates."""
    run = Run([*overrides, f"seed={seed}", f"trainer.steps={steps}"], base)
    run.train(steps)
    eval_loss = run.evaluate()["eval/loss"]
    step_ms = float(np.median(run.seconds[1:] or run.seconds)) * 1e3
    return Quality(seed, float(np.mean(run.losses[-tail:])), float(eval_loss), tail, step_ms)


class QualityPlan(NamedTuple):
    """What `train_variants` trains each variant for: its base overrides, model overrides
    (after the variant's), updates, seeds, and the updates the final training loss averages."""

    base: tuple[str, ...]
    model: tuple[str, ...]
    steps: int
    seeds: tuple[int, ...]
    tail: int


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample std, min and max of `values`, rounded to 4 places."""
    x = np.asarray(values, np.float64)
    return {
        "mean": round(float(x.mean()), 4),
        "std": round(float(x.std(ddof=1)) if len(x) > 1 else 0.0, 4),
        "min": round(float(x.min()), 4),
        "max": round(float(x.max()), 4),
    }


def train_variants(variants: Mapping[str, Sequence[str]], plan: QualityPlan) -> dict[str, Any]:
    """Every variant (name: its overrides) trained as `plan` says on each seed: per variant its
    runs and the spread of their final training loss, eval loss and step milliseconds."""
    out: dict[str, Any] = {"steps": plan.steps, "tail": plan.tail, "variants": {}}
    for name, overrides in variants.items():
        runs = [
            train_and_evaluate([*overrides, *plan.model], plan.steps, seed, plan.tail, plan.base)
            for seed in plan.seeds
        ]
        print(f"[quality] {name}: {runs}", file=sys.stderr, flush=True)
        out["variants"][name] = {
            "runs": [dataclasses.asdict(r) for r in runs],
            "train_loss": spread([r.train_loss for r in runs]),
            "eval_loss": spread([r.eval_loss for r in runs]),
            "step_ms": spread([r.step_ms for r in runs]),
        }
    return out


def with_gaps(quality: dict[str, Any], base: str) -> dict[str, Any]:
    """Sets each variant's ``vs_<base>``: its mean losses minus those of variant `base`."""
    first = quality["variants"][base]
    for v in quality["variants"].values():
        for key in ("train_loss", "eval_loss"):
            v[key][f"vs_{base}"] = round(v[key]["mean"] - first[key]["mean"], 4)
    return quality


class InnerLoop:
    """`benchmarks.timing.Steppable` over a run's inner (plain step) program, no sync."""

    def __init__(self, name: str, run: Run):
        self.name, self.run_ = name, run
        self.batch = run.trainer.global_batch(next(run.batches))

    def run(self, steps: int) -> None:
        """`steps` plain steps on one placed batch, each waited for."""
        trainer, r = self.run_.trainer, self.run_
        for _ in range(steps):
            r.state, metrics = trainer.step(r.state, self.batch, with_stats=False)
            metrics["train/loss"]  # fetched: waits for the step
        r.last_metrics = metrics


class SyncLoop:
    """`benchmarks.timing.Steppable` over a run's sync program alone (fragment 0)."""

    def __init__(self, name: str, run: Run):
        self.name, self.run_ = name, run

    def run(self, steps: int) -> None:
        """`steps` syncs in a row, each waited for."""
        for _ in range(steps):
            self.run_.force_sync()
