"""Float hyperparameters as inputs of the compiled programs: a checked factory call that can be
made again with other values (`FactoryCall`), and a config's inputs with the builder of its
optimizer (`Hyperparams`).

`xshard.optim.factory.build_optimizer_with_rules` reads and checks the config once, with its
Python values; ``Hyperparams.build(values)`` makes the same optimizer with the values of
`values` (by config key) in place of the config's. A step program passes float32 scalars it
takes as arguments (`trainers.core.step.programs`), so the floats are inputs of the program,
not constants folded into it; ``build(Hyperparams.values)`` is the optimizer as configured.
Which values are inputs is `xshard.config.program_inputs`'s rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from xshard.config.program_inputs import lifted_values
from xshard.config.ranges import Rule


class FactoryCall(NamedTuple):
    """A checked call ``fn(**kwargs)`` of the config node `key` (``optimizer``).

    Attributes:
      fn: the factory (the ``_target_``, resolved and allowed).
      kwargs: its keyword arguments as the config gives them (masks resolved).
      key: the node's config key; an input's key is ``<key>.<argument>``.
      target: the node's ``_target_``, for messages.
    """

    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    key: str
    target: str

    def __call__(self, values: Mapping[str, Any], *args: Any, **extra: Any) -> Any:
        """``fn(*args, **kwargs, **extra)`` with the values of `values` (by config key) in
        place of the config's."""
        kwargs = {k: values.get(f"{self.key}.{k}", v) for k, v in self.kwargs.items()}
        return self.fn(*args, **kwargs, **extra)

    def inputs(self, rules: Mapping[str, Rule]) -> dict[str, Any]:
        """The arguments that are inputs (`xshard.config.program_inputs.lifted_values`)."""
        return lifted_values(rules, self.kwargs, self.key)


class Hyperparams(NamedTuple):
    """A config's float hyperparameters and the builder of its optimizer from them.

    Attributes:
      values: every input (`xshard.config.program_inputs`), by config key
        (``optimizer.learning_rate``, ``schedule.end_factor``, ``clip``,
        ``reduction.axes.slice.outer_optimizer.momentum``): the config's Python numbers.
      build: ``values -> BuiltOptimizer`` (`xshard.optim.factory`): the optimizer and the axis
        rules with those values, e.g. float32 scalars traced in a step program. A population
        of trials stacks them on a leading axis (docs/sweeps.md).
    """

    values: dict[str, Any]
    build: Callable[[Mapping[str, Any]], Any]  # -> xshard.optim.factory.BuiltOptimizer

    def arrays(self) -> dict[str, Any]:
        """`values` as float32 scalars (NumPy): what a step program takes."""
        return {k: np.float32(v) for k, v in self.values.items()}
