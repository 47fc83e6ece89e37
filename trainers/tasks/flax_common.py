"""What the Flax NNX and linen tasks share: the loss by name, batch keys, data, sharding.

A Flax task is configured, not subclassed::

    task:
      _target_: trainers.tasks.flax_nnx.NNXTask     # or trainers.tasks.flax_linen.LinenTask
      model: {_target_: my_repo.models.MLP, hidden: 64}
      data: {_target_: trainers.tasks.synthetic.TeacherRegression, in_dim: 16, out_dim: 4}
      loss: mse                 # a name of LOSSES, or a node {_target_: ..., _partial_: true}
      inputs: x                 # the batch key the model is called on
      targets: y                # the batch key the loss compares the outputs with
      logical_axis_rules: {embed: null, mlp: model}
      dtype: ${precision.compute_dtype}        # Flax's `dtype`: the computation's
      param_dtype: ${precision.param_dtype}    # Flax's `param_dtype`: the params'
      remat: ${trainer.remat}                  # the model's layers rematerialised so

Precision and remat follow Flax's conventions: a model that takes ``dtype`` / ``param_dtype``
(module fields or constructor arguments, as ``nn.Dense`` and ``nnx.Linear`` do) is given them,
and one that takes ``remat`` is given the policy's name to apply to its layers with
``nn.remat`` / ``nnx.remat`` and `trainers.tasks.remat.checkpoint_policy` (the example models
in `trainers.tasks.nnx_models` and `trainers.tasks.linen_models` do). The model's floating-point
input is cast to ``dtype``; the trainer casts the params to it too, so a model without a
``dtype`` computes in it as well.

The task's ``batches`` are the data object's (any object with the ``batches`` method of
`trainers.tasks.base.Task`), so another data source plugs in without touching the model.
This module does not import Flax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from trainers.config.precision import NO_REMAT, check_dtype, check_remat
from trainers.data.batch import Batch
from trainers.tasks.logical import (
    check_logical_rules,
    exact_path_rules,
    specs_from_annotations,
)


def mse(
    outputs: jax.Array, targets: jax.Array | np.ndarray
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean squared error over every element; aux ``{"mse": ...}``."""
    value = jnp.mean(jnp.square(outputs.astype(jnp.float32) - targets))
    return value, {"mse": value}


def softmax_cross_entropy(
    outputs: jax.Array, targets: jax.Array | np.ndarray
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy of logits (..., classes) against integer labels (...); aux accuracy."""
    logits = outputs.astype(jnp.float32)
    labels = targets.astype(jnp.int32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
    return jnp.mean(nll), {"accuracy": accuracy}


#: Losses by name (``task.loss``): ``(outputs, targets) -> (mean loss, aux metrics)``.
LOSSES: dict[str, Callable[[jax.Array, jax.Array | np.ndarray], tuple[jax.Array, dict]]] = {
    "mse": mse,
    "softmax_cross_entropy": softmax_cross_entropy,
}


def resolve_loss(
    loss: str | Callable,
) -> Callable[[jax.Array, jax.Array | np.ndarray], tuple[jax.Array, dict]]:
    """``task.loss`` as a function returning (loss, aux).

    Args:
      loss: a name of `LOSSES`, or a function ``(outputs, targets)`` returning the mean loss
        or (mean loss, dict of scalar metrics) (a config node with ``_partial_: true``).

    Raises:
      ValueError: for an unknown name or a value that is not callable.
    """
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(
                f"task.loss={loss!r} is not a known loss; choose one of {list(LOSSES)}"
            )
        return LOSSES[loss]
    if not callable(loss):
        raise ValueError(
            f"task.loss={loss!r}: expected a name of {list(LOSSES)} or a function node "
            "({_target_: my_repo.losses.my_loss, _partial_: true})."
        )

    def wrapped(outputs, targets):
        out = loss(outputs, targets)
        return out if isinstance(out, tuple) else (out, {})

    return wrapped


class FlaxTask:
    """Base of the Flax tasks: loss, batch keys, data delegation and logical sharding.

    Subclasses fill `_annotations` (``{param path: logical names}``) when they initialise the
    model; `sharding_rules` maps them through ``logical_axis_rules``.

    Args:
      data: the data source: any object with ``batches(global_batch_size, *, seed,
        start_step, process_index, process_count)``.
      loss: a name of `LOSSES` or a function (see `resolve_loss`).
      inputs: the batch key of the model's input.
      targets: the batch key of the loss's targets.
      logical_axis_rules: ``{logical name: mesh axis | [mesh axes] | null}``.
      name: the task's name (for logging).
      dtype: the model's computation dtype (Flax's ``dtype``; ``precision.compute_dtype``);
        null: the model's own.
      param_dtype: the model's params' dtype (Flax's ``param_dtype``;
        ``precision.param_dtype``); null: the model's own.
      remat: the rematerialisation policy of the model's layers (``trainer.remat``).
    """

    def __init__(
        self,
        data: Any,
        loss: str | Callable = "mse",
        inputs: str = "x",
        targets: str = "y",
        logical_axis_rules: Mapping[str, Any] | None = None,
        name: str = "flax",
        *,
        dtype: str | None = None,
        param_dtype: str | None = None,
        remat: str = NO_REMAT,
    ):
        if not callable(getattr(data, "batches", None)):
            raise ValueError(
                f"task.data={data!r} has no batches method; give a data node such as "
                "{_target_: trainers.tasks.synthetic.TeacherRegression}."
            )
        for key, value in (("inputs", inputs), ("targets", targets)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"task.{key}={value!r}: expected a batch key (a string).")
        self.data = data
        self.loss_name = loss if isinstance(loss, str) else getattr(loss, "__name__", "loss")
        self._loss = resolve_loss(loss)
        self.inputs, self.targets = inputs, targets
        self.logical_axis_rules = check_logical_rules(logical_axis_rules)
        self.name = name
        self.dtype = None if dtype is None else check_dtype(dtype, "task.dtype")
        self.param_dtype = (
            None if param_dtype is None else check_dtype(param_dtype, "task.param_dtype")
        )
        self.remat = check_remat(remat, "task.remat")
        self._annotations: dict[str, tuple] | None = None
        tokens = getattr(data, "tokens_per_example", None)
        if tokens is not None:
            self.tokens_per_example = tokens

    # ---------------------------------------------------------------------------- sharding

    @property
    def logical_specs(self) -> dict[str, PartitionSpec]:
        """``{param path: PartitionSpec}`` of the annotated params (after ``init``).

        Raises:
          RuntimeError: before the model was initialised.
          ConfigError: for a logical name without a rule (listing the known ones).
        """
        if self._annotations is None:
            raise RuntimeError(f"{type(self).__name__}: initialise the model first")
        return specs_from_annotations(self._annotations, self.logical_axis_rules)

    @property
    def sharding_rules(self) -> list[tuple[str, PartitionSpec]]:
        """One exact-path rule per annotated parameter (after ``init``); others replicated."""
        return exact_path_rules(self.logical_specs)

    def _set_annotations(self, annotations: dict[str, tuple]) -> None:
        """Records the model's logical names and checks them against the rules now."""
        self._annotations = annotations
        specs_from_annotations(annotations, self.logical_axis_rules)  # ConfigError early

    # ---------------------------------------------------------------------------- precision

    def model_options(self, accepts: Callable[[str], bool]) -> dict[str, Any]:
        """The keyword arguments that give the model the task's ``dtype``, ``param_dtype`` and
        ``remat``: those it `accepts` (by name) and that are set.

        Raises:
          ValueError: ``remat`` is not ``none`` but the model takes no ``remat``: it could
            not apply it.
        """
        options = {"dtype": self.dtype, "param_dtype": self.param_dtype, "remat": self.remat}
        if self.remat != NO_REMAT and not accepts("remat"):
            raise ValueError(
                f"task.remat={self.remat!r} (trainer.remat): task.model takes no `remat` "
                "argument, so it cannot rematerialise its layers; give it one (a policy name "
                "for nn.remat / nnx.remat, trainers.tasks.remat.checkpoint_policy), or set "
                "trainer.remat=none."
            )
        return {
            key: value
            for key, value in options.items()
            if value is not None and accepts(key) and not (key == "remat" and value == NO_REMAT)
        }

    def model_inputs(self, batch: Batch) -> Any:
        """The model's input from `batch`, floating point cast to ``dtype`` (if set)."""
        x = batch[self.inputs]
        if self.dtype is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        return jnp.asarray(x).astype(self.dtype)

    # ---------------------------------------------------------------------------- loss

    def _check_batch(self, batch: Batch) -> None:
        missing = [k for k in (self.inputs, self.targets) if k not in batch]
        if missing:
            raise ValueError(
                f"the batch has keys {sorted(batch)}, not task.inputs/task.targets {missing}"
            )

    def _loss_of(self, outputs: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        return self._loss(outputs, batch[self.targets])

    if TYPE_CHECKING:  # the subclasses' (`LinenTask`, `NNXTask`); `eval_metrics` calls it

        def loss_with_state(
            self,
            params: Any,
            model_state: Any,
            batch: Batch,
            rng: jax.Array,
            *,
            train: bool = True,
        ) -> tuple[jax.Array, dict, Any]: ...

    # ---------------------------------------------------------------------------- data

    def batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """The data source's batches (`trainers.tasks.base.Task.batches`)."""
        return self.data.batches(
            global_batch_size,
            seed=seed,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
        )

    # ---------------------------------------------------------------------------- evaluation

    @property
    def has_eval_split(self) -> bool:
        """Whether the data source has an eval split (`trainers.hooks.evaluation`): an
        ``eval_batches`` method, and ``has_eval_split`` not False."""
        return callable(getattr(self.data, "eval_batches", None)) and bool(
            getattr(self.data, "has_eval_split", True)
        )

    def eval_batches(
        self,
        global_batch_size: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator[Batch]:
        """The data source's eval batches (`trainers.tasks.base`'s optional member)."""
        return self.data.eval_batches(
            global_batch_size, seed=seed, process_index=process_index, process_count=process_count
        )

    def eval_metrics(self, params: Any, model_state: Any, batch: Batch) -> dict[str, jax.Array]:
        """The loss and aux metrics in evaluation mode: running BatchNorm statistics, no
        dropout (``loss_with_state(..., train=False)``); the model state is not updated."""
        loss, aux, _ = self.loss_with_state(
            params, model_state, batch, jax.random.key(0), train=False
        )
        return {"loss": loss, **aux}
