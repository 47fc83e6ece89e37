"""The learning rate's part of the factory (`xshard.optim.factory`): the ``schedule`` node's
call, checked (`schedule_call`), the schedule with other hyperparameter values (`schedule_of`)
and the injected rate that follows it (`scheduled`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from xshard.config.schedule_schemas import check_schedule_args
from xshard.config.sections import check_kwargs, mapping
from xshard.config.targets import resolve_target
from xshard.errors import ConfigError
from xshard.optim.hyperparams import FactoryCall
from xshard.schedules import check_schedule


def required_target(node: dict[str, Any], prefix: str) -> str:
    """The ``_target_`` of the node `prefix` (``optimizer``, ``schedule``).

    Raises:
      ConfigError: naming ``<prefix>._target_`` when it is missing, with an example.
    """
    if node.get("_target_") is None:
        raise ConfigError(
            f"{prefix}._target_ is required: the dotted path of the factory to call, e.g. "
            f"{'optax.adamw' if prefix == 'optimizer' else 'xshard.schedules.warmup_cosine'}. "
            f"Or choose an option of the '{prefix}' group ({prefix}=<name>)."
        )
    return node["_target_"]


def schedule_call(learning_rate: float, node: Any, allowed: tuple[str, ...]) -> FactoryCall | None:
    """The ``schedule`` node's factory call, checked (built once on the base rate)."""
    if node is None:
        return None
    kwargs = mapping(node, "schedule")
    target = required_target(kwargs, "schedule")
    fn = resolve_target(target, allowed, key="schedule._target_")
    kwargs.pop("_target_")
    # The base rate goes to the first argument (`learning_rate`; optax's `init_value`).
    first = next(iter(inspect.signature(fn).parameters), None)
    check_kwargs(fn, kwargs, "schedule", target, supplied=() if first is None else (first,))
    check_schedule_args(kwargs)  # decay_steps, end_factor, ...: the schemas' rules, by name
    call = FactoryCall(fn, kwargs, "schedule", target)
    try:
        schedule = call({}, learning_rate)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"schedule ({target}): {e}") from e
    check_schedule(schedule, target, "schedule")
    return call


def schedule_of(
    values: Mapping[str, Any], learning_rate: float, schedule: FactoryCall | None
) -> optax.Schedule:
    """The schedule with `values` in place of the config's (none: the constant base rate)."""
    rate = values.get("optimizer.learning_rate", learning_rate)
    return optax.constant_schedule(rate) if schedule is None else schedule(values, rate)


def scheduled(
    injected: optax.GradientTransformationExtraArgs, schedule: optax.Schedule
) -> optax.GradientTransformationExtraArgs:
    """`injected` (``inject_hyperparams(fn)``) whose ``learning_rate`` follows `schedule`.

    optax's own schedule support also keeps a schedule state under the hyperparameter's name,
    which makes ``tree_get(state, "learning_rate")`` ambiguous. Instead the rate is a plain
    numeric hyperparameter, set from the schedule at the state's count before each update (as
    optax documents for editing ``state.hyperparams``), so it is the only "learning_rate" leaf.
    """

    def with_scheduled_rate(state: Any) -> Any:
        old = state.hyperparams["learning_rate"]
        rate = jnp.asarray(schedule(state.count), dtype=jnp.result_type(old))
        return state._replace(hyperparams={**state.hyperparams, "learning_rate": rate})

    def init_fn(params: Any) -> Any:
        return with_scheduled_rate(injected.init(params))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        return injected.update(updates, with_scheduled_rate(state), params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
