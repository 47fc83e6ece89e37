"""What `trainers.train` builds from the config before training: the task, the user's hooks,
and the checks that join config nodes (HParams: `trainers.hooks.hparams`).

Each builder reads the composed config and raises `xshard.ConfigError` naming the key. The
config checks of a run's start-up are two calls that `trainers.train` and `trainers.doctor`
share, so the doctor refuses what a run would refuse: `read_options` (the run's own nodes,
before any device or file is touched) and `build_run` (the task, hooks, optimizer and trainer
on the mesh, before any state is allocated or step compiled).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from trainers.config import (
        CheckpointOptions,
        DistributedOptions,
        LoggerOptions,
        PathsOptions,
        PrecisionOptions,
        ShardingOptions,
        TrainerOptions,
    )
    from trainers.tasks.base import Task

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The run's own config nodes, read and checked (`read_options`)."""

    seed: int
    trainer: TrainerOptions
    distributed: DistributedOptions
    paths: PathsOptions
    sharding: ShardingOptions
    checkpoint: CheckpointOptions
    logger: LoggerOptions
    precision: PrecisionOptions
    #: The training data's seed when it is not ``seed``: an elastic replica group's, a function
    #: of (seed, group) (`trainers.app.elastic_group`); None: ``seed``.
    data_seed: int | None = None


def read_options(cfg: DictConfig) -> RunOptions:
    """Reads the run's own nodes: ``seed``, ``trainer``, ``distributed``, ``paths``,
    ``sharding``, ``checkpoint``, ``logger`` and ``precision``, each into its record
    (`trainers.config`). Touches no device and no file.

    Raises:
      ConfigError: for the first bad value, naming the key, the value and what is allowed.
    """
    from trainers.config import (
        CheckpointOptions,
        DistributedOptions,
        LoggerOptions,
        PathsOptions,
        PrecisionOptions,
        ShardingOptions,
        TrainerOptions,
        check_seed,
    )
    from xshard.config import read_node

    seed = check_seed(cfg.get("seed"))
    trainer = read_node(TrainerOptions, cfg.get("trainer"), "trainer")
    distributed = read_node(DistributedOptions, cfg.get("distributed", {}), "distributed")
    paths = PathsOptions.from_config(cfg.get("paths"))
    return RunOptions(
        seed=seed,
        trainer=trainer,
        distributed=distributed,
        paths=paths,
        sharding=ShardingOptions.from_config(cfg.get("sharding")),
        checkpoint=CheckpointOptions.from_config(cfg.get("checkpoint")),
        logger=LoggerOptions.from_config(cfg.get("logger")),
        precision=PrecisionOptions.from_config(cfg.get("precision")),
    )


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a run trains, built from the config (`build_run`)."""

    task: Task
    hooks: list[Any]  # the user's, from trainer.hooks
    tx: Any  # the cross-shard optimizer (`xshard.optim.cross_shard.CrossShardTransformation`)
    spec: Any  # its `xshard.optim.cross_shard.CrossShardSpec` (``tx.spec``)
    trainer: Any  # a `trainers.Trainer`
    #: ``trainer.grad_impl`` -> its `Trainer`: the one path configured, or with ``auto`` each
    #: path the config can run (`trainers.app.grad_path`), `trainer` the first.
    paths: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_run(
    cfg: DictConfig, options: RunOptions, mesh: Any, data_axes: tuple[str, ...]
) -> RunParts:
    """Builds the task, the user's hooks, the optimizer and the `Trainer` on `mesh`.

    Allocates no training state and compiles no step: what is left to check once the devices
    and the mesh are known.

    Raises:
      ConfigError: for a bad task, hook, optimizer, schedule or reduction value, or trainer
        values that do not fit the mesh (naming the key, the value and what is allowed).
    """
    from trainers.app.population_run import trial_seat
    from trainers.core.precision import Precision
    from trainers.core.step.step_spec import periodic_inner_axes
    from trainers.core.trainer import Trainer
    from xshard.optim.factory import build_optimizer_with_rules

    opts, precision = options.trainer, options.precision
    task = build_task(cfg)
    check_task_remat(task, opts.remat, cfg.task.get("name", "task"))
    hooks = build_hooks(opts.hooks, allowed_targets(cfg))
    built = build_optimizer_with_rules(cfg, mesh=mesh)  # reads `reduction` once
    tx, periodic = built.tx, built.periodic
    check_reduction_axes(tx.spec.axis_name, periodic_inner_axes(data_axes, periodic))
    seat = trial_seat()  # hydra/launcher=population: the job's place in its population

    def trainer_of(grad_impl: str) -> Trainer:  # validates trainer.* against the mesh
        return Trainer(
            task,
            tx,  # it reduces as the reduction node says: the trainer reads `tx.spec`
            mesh,
            data_axes=data_axes,
            global_batch_size=opts.batch_size,
            microbatches=opts.microbatches,
            grad_impl=grad_impl,
            seed=options.seed,
            zero_stage=options.sharding.zero_stage,
            periodic=periodic,
            precision=Precision.of(precision.param_dtype, precision.compute_dtype),
            hyperparams=built.hyperparams,  # inputs of the compiled programs, not constants
            seat=seat,
        )

    # A population's trials step as one program: one path for all, not raced per trial.
    paths = path_trainers(trainer_of, opts.grad_impl, first_only=seat is not None)
    trainer = next(iter(paths.values()))
    return RunParts(task=task, hooks=hooks, tx=tx, spec=tx.spec, trainer=trainer, paths=paths)


def path_trainers(
    trainer_of: Callable[[str], Any], grad_impl: str, first_only: bool = False
) -> dict[str, Any]:
    """``grad_impl`` -> its `Trainer` (``trainer_of(grad_impl)``); with ``auto``, each path
    of `GRAD_IMPLS` whose trainer the config allows, in that order (only the first such path
    with `first_only`).

    Raises:
      ConfigError: the configured path's error; with ``auto``, the first path's if none is
        allowed.
    """
    from trainers.config.run import GRAD_IMPL_AUTO, GRAD_IMPLS
    from xshard.errors import ConfigError

    if grad_impl != GRAD_IMPL_AUTO:
        return {grad_impl: trainer_of(grad_impl)}
    paths, refused = {}, {}
    for name in GRAD_IMPLS:
        try:
            paths[name] = trainer_of(name)
        except ConfigError as e:
            refused[name] = str(e)
        if paths and first_only:
            break
    if not paths:
        raise ConfigError(refused[GRAD_IMPLS[0]])
    for name, why in refused.items():
        log.info("trainer.grad_impl=auto: not %s: %s", name, why)  # trainers.app.grad_path
    return paths


def build_task(cfg: DictConfig) -> Task:
    """Instantiates ``cfg.task`` after checking every ``_target_`` in it against the allowlist.

    Nested ``_target_`` nodes (a Flax task's ``model`` and ``data``) are built too, bottom-up
    (`xshard.config.targets.instantiate_nested`); each of them is checked by name before anything is
    imported, so a config cannot make the run import or call anything outside the allowlist
    (``trainers.tasks.*`` and ``allowed_targets``).

    Raises:
      ConfigError: for a missing, not allowed or unknown target, an unknown key, or a value
        the task rejects.
    """
    from xshard.config.sections import mapping, section
    from xshard.config.targets import instantiate_nested
    from xshard.errors import ConfigError

    node = mapping(section(cfg, "task", required=True), "task")
    if node.get("_target_") is None:
        raise ConfigError(
            "task._target_ is required, e.g. trainers.tasks.mlp.MLPTask; or "
            "choose an option of the 'task' group (task=mlp)."
        )
    return instantiate_nested(node, "task", allowed_targets(cfg))


def check_task_remat(task: Task, remat: str, name: str) -> None:
    """A task applies ``trainer.remat`` only if it opted in (its node has
    ``remat: ${trainer.remat}``, `trainers.tasks.remat`): refuse a policy it would ignore.

    Raises:
      ConfigError: naming ``trainer.remat``, the task and how to opt in.
    """
    from trainers.config.precision import NO_REMAT
    from trainers.tasks.remat import XLA_CPU_BARRIER_PASS, remat_undone_here
    from xshard.errors import ConfigError

    if remat != NO_REMAT and getattr(task, "remat", NO_REMAT) != remat:
        raise ConfigError(
            f"trainer.remat={remat!r}: task={name} does not apply it; a task opts in with "
            "`remat: ${trainer.remat}` in its node and a `remat` argument its layers use "
            "(trainers.tasks.remat, docs/tasks.md), or set trainer.remat=none."
        )
    if remat != NO_REMAT and remat_undone_here():
        log.warning(
            "trainer.remat=%s saves no memory on CPU: XLA:CPU merges the recomputation back; "
            "XLA_FLAGS=--xla_disable_hlo_passes=%s keeps it (docs/config.md).",
            remat,
            XLA_CPU_BARRIER_PASS,
        )


def build_hooks(nodes: list[Any], allowed: tuple[str, ...]) -> list[Any]:
    """The user's hooks from ``trainer.hooks``: ``[{_target_: mypkg.MyHook, arg: value}]``.

    Each target must be allowed (``allowed_targets``) and build a `trainers.Hook`; the run
    adds them after its built-in hooks.

    Raises:
      ConfigError: naming ``trainer.hooks[i]`` for a bad node, target or argument, or an
        object that is not a `trainers.Hook`.
    """
    from trainers.core.trainer import Hook
    from xshard.config.sections import mapping
    from xshard.config.targets import instantiate
    from xshard.errors import ConfigError

    hooks = []
    for i, node in enumerate(nodes):
        key = f"trainer.hooks[{i}]"
        hook = instantiate(mapping(node, key), key, allowed)
        if not isinstance(hook, Hook):
            raise ConfigError(
                f"{key}._target_={node['_target_']!r} built a {type(hook).__name__}, not a "
                "trainers.Hook: subclass trainers.Hook and override what you need."
            )
        hooks.append(hook)
    return hooks


def allowed_targets(cfg: DictConfig) -> tuple[str, ...]:
    """The run's `_target_` allowlist: the defaults plus the config's ``allowed_targets``."""
    from xshard.config.sections import section
    from xshard.config.targets import ALLOWED_TARGETS_KEY, allowed_prefixes

    return allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))


def check_reduction_axes(axis_name: Any, data_axes: tuple[str, ...]) -> None:
    """The trainer reduces every step over exactly the axes it splits the batch over (but a
    periodic one, `trainers.core.periodic`: `data_axes` are those).

    Reducing over fewer would leave replicas with different params; over more (a model axis)
    would sum gradients of different parameter shards.
    """
    from xshard.errors import ConfigError

    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if set(axes) != set(data_axes):
        raise ConfigError(
            f"reduction.axis_name={list(axes)} must name the data-parallel axes of the mesh, "
            f"mesh.data_axes={list(data_axes)}: the batch is split over those, so gradients "
            f"are reduced over them. Set reduction.axis_name={list(data_axes)}."
        )
