"""Schedule-free optimizers (optax.contrib.schedule_free*): their evaluation params, and the one
schedule they take.

Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled") trains at a point `y`
between two sequences and is evaluated at their average `x`, which
``optax.contrib.schedule_free_eval_params(state, params)`` computes from the raw params and the
state's `z`. `eval_params` finds that state wherever it sits (inside `xshard.cross_shard`, a
chain, ``inject_hyperparams``). The averaging replaces the decay of the learning rate, so a
decaying schedule is refused (`check_schedule_free`): optax documents its rate as a
"schedule w/o decay but with warmup", and the paper's results use none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import ScheduleFreeState, schedule_free_eval_params

from xshard.errors import ConfigError
from xshard.optim.slots import find_states

#: The schedule-free optax factories (an ``optimizer._target_`` that resolves to one of them).
SCHEDULE_FREE: tuple[Callable[..., Any], ...] = (
    optax.contrib.schedule_free_adamw,
    optax.contrib.schedule_free_sgd,
)

#: Steps the schedule is sampled at: 0 and every power of two below 2**31.
_STEPS = np.array([0, *(2**k for k in range(31))], dtype=np.int32)


def eval_params(opt_state: optax.OptState, params: Any) -> Any:
    """The params to evaluate: schedule-free's average `x` if `opt_state` holds a
    `optax.contrib.ScheduleFreeState`, else `params` themselves.

    Args:
      opt_state: the optimizer state (a `cross_shard` state, or any optax state).
      params: the params it trains (the schedule-free `y`).

    Returns:
      ``schedule_free_eval_params(<the ScheduleFreeState>, params)``, or `params`.
    """
    found = find_states(opt_state, ScheduleFreeState)
    return schedule_free_eval_params(found[0], params) if found else params


def check_schedule_free(
    fn: Callable[..., Any], args: dict[str, Any], schedule: Any, schedule_target: str
) -> None:
    """For a schedule-free optimizer `fn`, refuses ``b1=0`` and a decaying schedule.

    Args:
      fn: the optimizer factory (nothing is checked unless it is one of `SCHEDULE_FREE`).
      args: its keyword arguments from config.
      schedule: the learning-rate schedule, or a constant rate (not callable).
      schedule_target: ``schedule._target_``, for the message.

    The schedule is sampled at step 0 and every power of two; a warmup (a rate that never
    falls) is allowed.

    Raises:
      ConfigError: naming the key, the value and what to use instead.
    """
    if fn not in SCHEDULE_FREE:
        return
    if args.get("b1", 0.9) == 0:  # the evaluation params divide by it
        raise ConfigError(
            "optimizer.b1=0: schedule-free AdamW interpolates with b1 and its evaluation "
            "params divide by it; expected 0 < b1 < 1."
        )
    if not callable(schedule):
        return
    rates = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(_STEPS)))
    peak = np.maximum.accumulate(rates)
    falls = np.flatnonzero(rates < peak)
    if falls.size:
        i = int(falls[0])
        raise ConfigError(
            f"schedule._target_={schedule_target!r} decays the learning rate ({rates[i]:.3g} "
            f"at step {_STEPS[i]}, below its peak {peak[i]:.3g}), but optimizer."
            f"_target_={fn.__module__.split('._')[0]}.{fn.__name__} is schedule-free: its "
            "averaging replaces the decay. Use schedule=constant (warm up with "
            "optimizer.warmup_steps)."
        )
