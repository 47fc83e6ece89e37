"""task: a Flax linen model, configured as a node: ``task.model: {_target_: my_repo.GPT, ...}``.

The model node is built into the linen module (a dataclass; nothing is initialised yet). The
task's ``init_with_state`` runs ``model.init`` inside the trainer's jitted init; the
``params`` collection (unboxed: ``nn.with_logical_partitioning`` names are read, not kept) is
what the optimizer trains, with paths like ``layers_0/kernel``; every other collection
(``batch_stats``, your own) is the model state (`trainers.core.model_state`), applied as mutable
collections in each step and carried to the next and into checkpoints.

Each step calls ``model.apply`` with ``rngs={<rng_collections>: key from the step's key}``
and, when ``train_arg`` is set, that keyword as True (False for evaluation). Inside the manual
step, BatchNorm layers without an ``axis_name`` compute their statistics over the data shards
(``sync_batch_norm``): those of the global batch, identical on every shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from trainers.data.batch import Batch
from trainers.tasks.flax_common import FlaxTask
from trainers.tasks.flax_state import manual_axes
from xshard.stats.tree import path_str


class LinenTask(FlaxTask):
    """A Flax linen model trained on a configured data source with a configured loss.

    Args:
      model: the linen module (from the config: the ``task.model`` node).
      data, loss, inputs, targets, logical_axis_rules, name: see `FlaxTask`.
      train_arg: a keyword of the model's ``__call__`` set to True in training steps and
        False in evaluation (e.g. ``train``); null: none is passed.
      rng_collections: the RNG collections the model draws from (e.g. ``dropout``).
      sync_batch_norm: inside the manual step, BatchNorm layers without an ``axis_name``
        reduce their statistics over the data axes (those of the global batch).
      dtype, param_dtype, remat: set on the model (``model.clone``) if it has those fields
        (`FlaxTask`).
    """

    def __init__(
        self,
        model: nn.Module,
        data: Any,
        loss: str | Callable = "mse",
        inputs: str = "x",
        targets: str = "y",
        logical_axis_rules: Mapping[str, Any] | None = None,
        train_arg: str | None = None,
        rng_collections: Sequence[str] = ("dropout",),
        sync_batch_norm: bool = True,
        name: str = "flax_linen",
        *,
        dtype: str | None = None,
        param_dtype: str | None = None,
        remat: str = "none",
    ):
        if not isinstance(model, nn.Module):
            raise ValueError(f"task.model built a {type(model).__name__}, not a linen Module")
        super().__init__(
            data,
            loss,
            inputs,
            targets,
            logical_axis_rules,
            name,
            dtype=dtype,
            param_dtype=param_dtype,
            remat=remat,
        )
        fields = {f.name for f in dataclasses.fields(model)}
        options = self.model_options(fields.__contains__)
        self.model = model.clone(**options) if options else model
        self.train_arg = train_arg
        self.rng_collections = tuple(rng_collections)
        self.sync_batch_norm = bool(sync_batch_norm)

    def _kwargs(self, train: bool) -> dict[str, Any]:
        return {} if self.train_arg is None else {self.train_arg: train}

    def init_with_state(self, rng: jax.Array, batch: Batch) -> tuple[Any, Any]:
        """``model.init`` on the example batch; returns (params, other collections).

        Raises:
          ValueError: the batch lacks the configured keys.
          ConfigError: a logical axis name of the model has no rule.
        """
        self._check_batch(batch)
        keys = jax.random.split(rng, 1 + len(self.rng_collections))
        rngs = {"params": keys[0], **dict(zip(self.rng_collections, keys[1:]))}
        variables = self.model.init(rngs, self.model_inputs(batch), **self._kwargs(False))
        params = variables.get("params", {})
        annotations = {}
        for path, box in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )[0]:
            if isinstance(box, nn.Partitioned):
                annotations[path_str(path)] = tuple(box.names)
        self._set_annotations(annotations)
        plain = nn.meta.unbox(dict(variables))
        state = {k: v for k, v in plain.items() if k != "params"}
        return dict(plain.get("params", {})), state

    def loss_with_state(
        self,
        params: Any,
        model_state: Any,
        batch: Batch,
        rng: jax.Array,
        *,
        train: bool = True,
    ) -> tuple[jax.Array, dict, Any]:
        """``model.apply`` with the model state as mutable collections; returns (mean loss,
        aux metrics, new model state)."""
        keys = jax.random.split(rng, max(len(self.rng_collections), 1))
        rngs = dict(zip(self.rng_collections, keys))
        variables = {"params": params, **model_state}
        mutable = list(model_state) if train and model_state else False
        axes = manual_axes() if self.sync_batch_norm else ()

        def sync(next_fun, args, kwargs, context):
            module = context.module
            if axes and isinstance(module, nn.BatchNorm) and module.axis_name is None:
                object.__setattr__(module, "axis_name", axes)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(sync):
            out = self.model.apply(
                variables,
                self.model_inputs(batch),
                rngs=rngs,
                mutable=mutable,
                **self._kwargs(train),
            )
        outputs: Any  # the model's output (flax types `out` as output or (output, state))
        outputs, new_state = out if mutable else (out, model_state)
        loss, aux = self._loss_of(outputs, batch)
        return loss, aux, {k: new_state[k] for k in model_state}
