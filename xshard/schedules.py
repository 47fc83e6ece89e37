"""Learning-rate schedules named by the ``schedule`` config group.

Every factory here takes the optimizer's base (peak) rate ``learning_rate`` as its first
argument and expresses the other levels as fractions of it (``init_factor``, ``end_factor``), so
``optimizer.learning_rate=3e-4`` rescales the whole curve. Steps count optimizer updates; a step
skipped for a non-finite gradient does not advance the schedule. ``decay_steps`` counts the
whole schedule, warmup included, as in optax.

A custom schedule for ``schedule._target_`` follows the same convention:
``fn(learning_rate, **schedule_cfg) -> optax.Schedule``.

Each argument obeys one rule, the same whichever schedule has it, written once in
`xshard.config.schedule_schemas.SCHEDULE_RULES`; a factory called with a value out of range raises
`xshard.ConfigError` (a ValueError) naming the argument, the value and what is allowed.
`check_schedule` checks that what a schedule node built is one (``schedule``, and a periodic
axis's ``outer_optimizer.learning_rate`` node).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from xshard.config.schedule_schemas import check_schedule_args
from xshard.errors import ConfigError

logger = logging.getLogger(__name__)


def _check(args: dict[str, Any]) -> None:
    """`check_schedule_args` of the Python values of `args`: an array (a hyperparameter the
    step program takes as an input, `xshard.optim.hyperparams`) was checked when it was the
    config's number."""
    check_schedule_args({k: v for k, v in args.items() if not isinstance(v, jax.Array)}, "")


def _warmup_only(warmup_steps: int, decay_steps: int) -> bool:
    """Warns (and returns True) when the warmup outlasts the run."""
    if warmup_steps >= decay_steps:
        logger.warning(
            "schedule.warmup_steps=%d >= schedule.decay_steps=%d: the schedule is warmup only "
            "and never decays (short run?).",
            warmup_steps,
            decay_steps,
        )
        return True
    return False


def _warmup_then(
    learning_rate: float,
    warmup_steps: int,
    decay_steps: int,
    init_factor: float,
    decay: Callable[[int], optax.Schedule],
) -> optax.Schedule:
    """Linear warmup from ``init_factor * learning_rate``, then ``decay(steps left)``, with
    optax's pieces (optax has no warmup-then-linear-decay schedule of its own).

    A warmup that outlasts `decay_steps` is all there is (with a warning).
    """
    only = _warmup_only(warmup_steps, decay_steps)
    if warmup_steps == 0:
        return decay(decay_steps)
    warmup = optax.linear_schedule(init_factor * learning_rate, learning_rate, warmup_steps)
    if only:
        return warmup
    return optax.join_schedules([warmup, decay(decay_steps - warmup_steps)], [warmup_steps])


def constant(learning_rate: float) -> optax.Schedule:
    """The rate stays at `learning_rate`."""
    return optax.constant_schedule(learning_rate)


def cosine(
    learning_rate: float, *, decay_steps: int, end_factor: float = 0.0, exponent: float = 1.0
) -> optax.Schedule:
    """Cosine decay from `learning_rate` to ``end_factor * learning_rate`` over `decay_steps`."""
    _check(dict(decay_steps=decay_steps, end_factor=end_factor, exponent=exponent))
    return optax.cosine_decay_schedule(
        learning_rate, decay_steps, alpha=end_factor, exponent=exponent
    )


def warmup_cosine(
    learning_rate: float,
    *,
    warmup_steps: int,
    decay_steps: int,
    init_factor: float = 0.0,
    end_factor: float = 0.0,
    exponent: float = 1.0,
) -> optax.Schedule:
    """Linear warmup to `learning_rate` over `warmup_steps`, then cosine decay to the end.

    Args:
      learning_rate: the peak rate.
      warmup_steps: steps of linear warmup from ``init_factor * learning_rate``.
      decay_steps: length of the whole schedule, warmup included.
      init_factor: the first rate, as a fraction of `learning_rate`.
      end_factor: the final rate, as a fraction of `learning_rate`.
      exponent: exponent of the cosine (1.0: the usual half cosine).

    Returns:
      An optax schedule.

    Raises:
      ConfigError: (a ValueError) for an argument out of range (`SCHEDULE_RULES`).
    """
    _check(
        dict(
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            init_factor=init_factor,
            end_factor=end_factor,
            exponent=exponent,
        )
    )
    only = _warmup_only(warmup_steps, decay_steps)
    if warmup_steps == 0:
        return cosine(
            learning_rate, decay_steps=decay_steps, end_factor=end_factor, exponent=exponent
        )
    if only:
        return optax.linear_schedule(init_factor * learning_rate, learning_rate, warmup_steps)
    # optax.warmup_cosine_decay_schedule's pieces, with `end_factor` as the cosine's alpha:
    # optax's own divides end_value by peak_value after a Python test of peak_value == 0,
    # which a traced rate (an input of the step) cannot pass.
    cosine_part = optax.cosine_decay_schedule(
        learning_rate, decay_steps - warmup_steps, alpha=end_factor, exponent=exponent
    )
    warmup = optax.linear_schedule(init_factor * learning_rate, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, cosine_part], [warmup_steps])


def warmup_linear(
    learning_rate: float,
    *,
    warmup_steps: int,
    decay_steps: int,
    init_factor: float = 0.0,
    end_factor: float = 0.0,
) -> optax.Schedule:
    """Linear warmup to `learning_rate` over `warmup_steps`, then linear decay to the end.

    Args:
      learning_rate: the peak rate.
      warmup_steps: steps of linear warmup from ``init_factor * learning_rate``.
      decay_steps: length of the whole schedule, warmup included.
      init_factor: the first rate, as a fraction of `learning_rate`.
      end_factor: the final rate, as a fraction of `learning_rate`.

    Returns:
      An optax schedule.

    Raises:
      ConfigError: (a ValueError) for an argument out of range (`SCHEDULE_RULES`).
    """
    _check(
        dict(
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            init_factor=init_factor,
            end_factor=end_factor,
        )
    )
    return _warmup_then(
        learning_rate,
        warmup_steps,
        decay_steps,
        init_factor,
        lambda n: optax.linear_schedule(learning_rate, end_factor * learning_rate, n),
    )


def exponential(
    learning_rate: float,
    *,
    transition_steps: int,
    decay_rate: float,
    warmup_steps: int = 0,
    staircase: bool = False,
    end_factor: float | None = None,
) -> optax.Schedule:
    """``learning_rate * decay_rate ** (t / transition_steps)``, after an optional warmup.

    Args:
      learning_rate: the peak rate.
      transition_steps: steps over which the rate is multiplied by `decay_rate`.
      decay_rate: the factor per `transition_steps` (< 1 decays).
      warmup_steps: steps of linear warmup from 0; ``t`` counts from its end.
      staircase: decay in discrete jumps every `transition_steps`.
      end_factor: a floor (or ceiling, if `decay_rate` > 1) as a fraction of `learning_rate`.

    Returns:
      An optax schedule.

    Raises:
      ConfigError: (a ValueError) for an argument out of range (`SCHEDULE_RULES`).
    """
    _check(
        dict(
            transition_steps=transition_steps,
            decay_rate=decay_rate,
            warmup_steps=warmup_steps,
            end_factor=end_factor,
        )
    )
    end_value = None if end_factor is None else end_factor * learning_rate
    if warmup_steps == 0:
        return optax.exponential_decay(
            learning_rate, transition_steps, decay_rate, staircase=staircase, end_value=end_value
        )
    return optax.warmup_exponential_decay_schedule(
        0.0,
        learning_rate,
        warmup_steps,
        transition_steps,
        decay_rate,
        staircase=staircase,
        end_value=end_value,
    )


def check_schedule(schedule: Any, target: str, key: str) -> optax.Schedule:
    """`schedule`, checked to map a step count to one learning rate (on an abstract step).

    Args:
      schedule: what the node's target built.
      target: the node's ``_target_``, for the message.
      key: the node's config key (``schedule``, or an ``outer_optimizer.learning_rate``).

    Raises:
      ConfigError: naming ``<key>._target_`` if it is not such a function.
    """
    wrong = f"{key}._target_={target!r} did not build a schedule (step -> learning rate)"
    if not callable(schedule) or isinstance(schedule, optax.GradientTransformation):
        raise ConfigError(
            f"{wrong}; it returned a {type(schedule).__name__}. Use a schedule factory, "
            "e.g. xshard.schedules.warmup_cosine or optax.cosine_decay_schedule."
        )
    try:
        out = jax.eval_shape(schedule, jax.ShapeDtypeStruct((), jnp.int32))
    except Exception as e:  # any failure to trace `schedule(step)` means it is not one
        raise ConfigError(f"{wrong}: calling it on a step failed ({type(e).__name__}).") from e
    if not (
        isinstance(out, jax.ShapeDtypeStruct)
        and out.shape == ()
        and jnp.issubdtype(out.dtype, jnp.floating)
    ):
        raise ConfigError(f"{wrong}: schedule(step) gave {out}, not a scalar float.")
    return schedule
