"""A saved checkpoint put to use: `load` for a notebook, `evaluate_checkpoint` for
``python -m trainers.evaluate``, `export_params` to a plain ``.npz``.

Each reads the run's saved config as untrusted input (`trainers.app.run_dir_config`), builds
the task, optimizer and trainer with the same builders as training (`trainers.app.builders`), and
restores the checkpoint into them with the same checks (`trainers.checkpoint.resume`: the
state's structure, shapes and dtypes, the checksums). The mesh is the one this process has:
`load` uses one device and hands back host NumPy arrays (no mesh of 8 needed), `evaluate` the
run's ``mesh`` when its devices exist here (``mesh=cpu8`` simulates them), or any ``mesh=``
override.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from omegaconf import DictConfig, open_dict

from trainers.app.run_dir_config import CHECKPOINTS, checked_run_dir, read_run_config

if TYPE_CHECKING:
    from trainers.tasks.base import Task


class Loaded(NamedTuple):
    """A checkpoint, loaded for inference.

    Attributes:
      params: the trained params, host NumPy arrays in the task's own tree structure: the
        params to evaluate (`trainers.core.periodic.outer_params`: a periodic run's outer
        params, a schedule-free optimizer's evaluation params).
      model_state: the model state (BatchNorm statistics, ...; ``{}`` for a plain task).
      config: the run's config (`trainers.app.run_dir_config.read_run_config`).
      step: the checkpoint's step.
      task: the task built from the config (its ``apply``, ``loss`` and data).
    """

    params: Any
    model_state: Any
    config: DictConfig
    step: int
    task: Task


class Restored(NamedTuple):
    """A checkpoint restored onto a mesh: the run's parts and its `TrainState`."""

    parts: Any
    state: Any
    step: int


def restore_run(
    cfg: DictConfig,
    run_dir: Path,
    step: int | None,
    mesh: Any,
    data_axes: tuple[str, ...],
    saved_replicas: bool = False,
) -> Restored:
    """Builds the run's task and trainer on `mesh` and restores checkpoint `step` (None: the
    latest complete one) into them. With `saved_replicas` (`mesh` smaller than the run's),
    the per-replica arrays of a periodic axis or an axis rule are restored as saved
    (`trainers.checkpoint.resume.with_saved_replica_shapes`): to read, not to train on.

    Raises:
      ConfigError: a bad config value (naming the key).
      CheckpointError: no such step, or a checkpoint that does not match or is corrupted.
    """
    import jax

    from trainers.app.builders import build_run, read_options
    from trainers.checkpoint.io import complete_steps
    from trainers.checkpoint.resume import (
        RestoreSource,
        restore_checkpoint,
        with_saved_replica_shapes,
    )
    from trainers.config.plain import run_config
    from trainers.exits import CheckpointError

    with open_dict(cfg):
        cfg.trainer.hooks = []  # the user's hooks log training; none is needed here
    options = read_options(cfg)
    directory = run_dir / CHECKPOINTS
    steps = complete_steps(directory)
    if not steps or (step is not None and step not in steps):
        raise CheckpointError(
            f"{directory} has no complete checkpoint"
            + (f" of step={step}" if step is not None else "")
            + (f"; its steps: {steps}." if steps else ".")
        )
    parts = build_run(cfg, options, mesh, data_axes)
    trainer, task, seed = parts.trainer, parts.task, options.seed
    first = next(iter(task.batches(options.trainer.batch_size, seed=seed)), None)
    if first is None:
        raise CheckpointError(f"the task of {run_dir} yields no batch to build its state from.")
    state = trainer.init(*trainer.init_variables(first))
    target: Any = state
    if saved_replicas:
        periodic = () if trainer.periodic is None else (trainer.periodic.axis,)
        ruled = tuple(axis for axis, _ in parts.tx.spec.axes.rules)
        step_dir = directory / str(steps[-1] if step is None else step)
        target = with_saved_replica_shapes(state, step_dir, periodic + ruled)
    source = RestoreSource(directory, step)
    state = restore_checkpoint(source, target, run_config(cfg), action="Reading")
    state = trainer.row_order(state)  # checkpoints hold Muon's momentum in row order
    return Restored(parts, state, int(jax.device_get(state.step)))


def load(run_dir: str | Path, step: int | None = None, overrides: Sequence[str] = ()) -> Loaded:
    """Loads a run's checkpoint for inference, on one device, as host NumPy arrays.

        run = trainers.load("outputs/2025-01-01/12-00-00")      # the latest checkpoint
        preds = run.task.apply(run.params, x)                    # task=mlp's model
        model = run.task.merge(run.params, run.model_state)      # a Flax NNX task's module

    Args:
      run_dir: the run's dir (its ``hydra.run.dir``: ``.hydra/config.yaml``, ``checkpoints/``),
        relative to the working directory now, ``~`` expanded.
      step: the checkpoint's step; None: the latest complete one.
      overrides: ``key=value`` config overrides; ``+allowed_targets=[mypkg.]`` trusts your
        own package's ``_target_``s the saved config names (a saved config cannot widen the
        allowlist itself; an installed package's ``xshard.allowed_targets`` entry point, or
        ``XSHARD_ALLOWED_TARGETS``, does too).

    Returns:
      A `Loaded`.

    Raises:
      ConfigError: not a run dir, or a bad or untrusted config.
      CheckpointError: no such step, or an unusable checkpoint.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    from trainers.core.periodic import outer_params
    from xshard.mesh.spec import data_axes as mesh_data_axes

    path = checked_run_dir(run_dir)
    cfg = read_run_config(path, overrides)
    # The run's mesh axes, each of size 1: its axis rules and periodic axis still name them.
    axes = tuple(cfg.mesh.axes) if cfg.get("mesh") is not None else ("data",)
    device = np.array(jax.devices()[:1]).reshape((1,) * len(axes))
    mesh = Mesh(device, axes, axis_types=(AxisType.Auto,) * len(axes))
    data_axes = mesh_data_axes(cfg.mesh) if cfg.get("mesh") is not None else ("data",)
    restored = restore_run(cfg, path, step, mesh, data_axes, saved_replicas=True)
    state = jax.device_get(restored.state)
    params = outer_params(state)  # the replicas' last agreed params; schedule-free: eval params
    return Loaded(params, state.model_state, cfg, restored.step, restored.parts.task)


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """``{parameter path: array}``, the paths as sharding rules match them
    (``blocks/0/attn/wq``, `xshard.stats.tree.path_str`)."""
    import jax

    from xshard.stats.tree import path_str

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {path_str(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def export_params(params: Any, path: str | Path) -> Path:
    """Writes `params` to a ``.npz`` keyed by parameter path, loadable with ``np.load`` alone.

    Returns:
      The file written (``.npz`` appended if missing, as NumPy does).
    """
    out = Path(path)
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **flat_params(params))  # type: ignore[arg-type]
    return out


class Evaluation(NamedTuple):
    """What `evaluate_checkpoint` did: the step, its metrics and where they were written."""

    step: int
    metrics: dict[str, float]
    path: Path


def evaluate_checkpoint(
    run_dir: str | Path, step: int | None = None, overrides: Sequence[str] = ()
) -> Evaluation:
    """Evaluates a run's checkpoint on the task's eval split, every example once
    (`trainers.hooks.evaluation`), and writes the metrics to ``<run dir>/eval_step<N>.json``.

    Args:
      run_dir: the run's dir.
      step: the checkpoint's step; None: the latest complete one.
      overrides: ``key=value`` config overrides (``trainer.eval_batches=100``, ``mesh=cpu4``).

    Raises:
      ConfigError: not a run dir, a bad or untrusted config, or a task with no eval split.
      CheckpointError: no such step, or an unusable checkpoint.
    """
    import json

    from trainers.app.builders import read_options
    from trainers.hooks.evaluation import build_evaluator
    from trainers.rundir.links import write_file
    from xshard.mesh.build import build_mesh, configure_devices
    from xshard.mesh.spec import data_axes as mesh_data_axes

    path = checked_run_dir(run_dir)
    cfg = read_run_config(path, overrides)
    configure_devices(cfg.mesh)
    mesh, data_axes = build_mesh(cfg.mesh), mesh_data_axes(cfg.mesh)
    restored = restore_run(cfg, path, step, mesh, data_axes)
    options = read_options(cfg)
    evaluator = build_evaluator(
        restored.parts.task,
        mesh,
        restored.state,
        data_axes=data_axes,
        opts=options.trainer,
        seed=options.seed,
        compute_dtype=restored.parts.trainer.precision.compute_dtype,
    )
    if evaluator is None:
        from xshard.errors import ConfigError

        raise ConfigError(
            f"the task of {run_dir} has no eval split (or trainer.eval_batches=0): nothing to "
            "evaluate."
        )
    metrics = evaluator.evaluate(restored.state)
    record = {"step": restored.step, "examples": evaluator.examples, "metrics": metrics}
    out = write_file(path / f"eval_step{restored.step}.json", json.dumps(record, indent=2) + "\n")
    return Evaluation(restored.step, metrics, out)
