"""What `trainers.train` builds from the config before training: the task, the user's hooks,
and the checks that join config nodes (HParams: `trainers.hparams`).

Each builder reads the composed config and raises `xshard.ConfigError` naming the key.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


def build_task(cfg: DictConfig) -> Any:
    """Instantiates ``cfg.task`` after checking every ``_target_`` in it against the allowlist.

    Nested ``_target_`` nodes (a Flax task's ``model`` and ``data``) are built too, bottom-up
    (`xshard.targets.instantiate_nested`); each of them is checked by name before anything is
    imported, so a config cannot make the run import or call anything outside the allowlist
    (``trainers.tasks.*`` and ``allowed_targets``).

    Raises:
      ConfigError: for a missing, not allowed or unknown target, an unknown key, or a value
        the task rejects.
    """
    from xshard.config_nodes import mapping, section
    from xshard.errors import ConfigError
    from xshard.targets import instantiate_nested

    node = mapping(section(cfg, "task", required=True), "task")
    if node.get("_target_") is None:
        raise ConfigError(
            "task._target_ is required, e.g. trainers.tasks.mlp.MLPTask; or "
            "choose an option of the 'task' group (task=mlp)."
        )
    return instantiate_nested(node, "task", allowed_targets(cfg))


def build_hooks(nodes: list[Any], allowed: tuple[str, ...]) -> list[Any]:
    """The user's hooks from ``trainer.hooks``: ``[{_target_: mypkg.MyHook, arg: value}]``.

    Each target must be allowed (``allowed_targets``) and build a `trainers.Hook`; the run
    adds them after its built-in hooks.

    Raises:
      ConfigError: naming ``trainer.hooks[i]`` for a bad node, target or argument, or an
        object that is not a `trainers.Hook`.
    """
    from trainers.trainer import Hook
    from xshard.config_nodes import mapping
    from xshard.errors import ConfigError
    from xshard.targets import instantiate

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
    from xshard.config_nodes import section
    from xshard.targets import ALLOWED_TARGETS_KEY, allowed_prefixes

    return allowed_prefixes(section(cfg, ALLOWED_TARGETS_KEY, required=False))


def check_reduction_axes(axis_name: Any, data_axes: tuple[str, ...]) -> None:
    """The trainer reduces over exactly the axes it splits the batch over.

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
