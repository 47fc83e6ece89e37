"""task: a Flax NNX model, configured as a node: ``task.model: {_target_: my_repo.GPT, ...}``.

The model node is passed to `NNXTask` as a factory (``factory_args``); the task calls it with
``rngs=nnx.Rngs(<the run's init key>)`` inside the trainer's jitted init (Flax's eager
sharding is off there: the trainer places the params from their logical names) and splits the
module once into its static graph and its state:

- the ``nnx.Param`` variables are the params the optimizer trains, as nested dicts with string
  keys: the path of ``self.layers[0].kernel`` is ``layers/0/kernel``;
- every other variable (``nnx.BatchStat``, RNG keys and counters, your own ``nnx.Variable``
  types) is the model state (`trainers.core.model_state`), carried through the steps and saved in
  checkpoints (RNG keys as their raw ``uint32`` data).

Each step merges graph and state into a module *while tracing* (no host work per step), runs
it in training mode, and splits the new state back out. Inside the manual step, BatchNorm
layers without an ``axis_name`` compute their statistics over the data shards
(``sync_batch_norm``): normalisation and running statistics are those of the global batch,
identical on every shard. Dropout keys come from the trainer's step key (a pure function of
seed, step and shard); the model's own keys stay as initialised and its counters advance.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainers.data.batch import Batch
from trainers.tasks.flax_common import FlaxTask
from trainers.tasks.flax_state import manual_axes, nested, path_key


class NNXTask(FlaxTask):
    """A Flax NNX model trained on a configured data source with a configured loss.

    Args:
      model: a factory of the model, called as ``model(rngs=nnx.Rngs(key))``: from the config,
        the ``task.model`` node (``_target_`` and the model's other arguments).
      data, loss, inputs, targets, logical_axis_rules, name: see `FlaxTask`.
      sync_batch_norm: inside the manual step, give BatchNorm layers without an
        ``axis_name`` the data axes, so that their statistics are the global batch's.
      dtype, param_dtype, remat: passed to the model factory if it takes them (`FlaxTask`).
    """

    #: ``task.model`` is passed as a factory (`xshard.config.targets.instantiate_nested`).
    factory_args = ("model",)

    def __init__(
        self,
        model: Callable[..., nnx.Module],
        data: Any,
        loss: str | Callable = "mse",
        inputs: str = "x",
        targets: str = "y",
        logical_axis_rules: Mapping[str, Any] | None = None,
        sync_batch_norm: bool = True,
        name: str = "flax_nnx",
        *,
        dtype: str | None = None,
        param_dtype: str | None = None,
        remat: str = "none",
    ):
        if not callable(model):
            raise ValueError(f"task.model={model!r}: expected a model node with a _target_.")
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
        self.model = model
        self.sync_batch_norm = bool(sync_batch_norm)
        self._graphdef: Any = None
        self._param_vars: list[tuple[tuple, nnx.Variable]] = []
        self._state_vars: list[tuple[tuple, nnx.Variable]] = []
        self._key_impls: dict[tuple, Any] = {}

    # ------------------------------------------------------------------------------ init

    def init_with_state(self, rng: jax.Array, batch: Batch) -> tuple[Any, Any]:
        """Builds the model with `rng`, splits it once; returns (params, model state).

        Args:
          rng: the init key (the model gets ``nnx.Rngs(rng)``).
          batch: an example batch (its keys are checked).

        Returns:
          Nested dicts of arrays with string keys: the ``nnx.Param`` values, and every other
          variable's value (RNG keys as ``uint32`` key data).

        Raises:
          ValueError: the factory did not build an ``nnx.Module``, or the batch lacks keys.
          ConfigError: a logical axis name of the model has no rule.
        """
        self._check_batch(batch)
        options = self.model_options(_takes(self.model))
        with nnx.use_eager_sharding(False):
            module = self.model(rngs=nnx.Rngs(rng), **options)
        if not isinstance(module, nnx.Module):
            raise ValueError(f"task.model built a {type(module).__name__}, not an nnx.Module")
        # With two filters, split returns three items; flax types it as a variadic tuple.
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
        self._graphdef = graphdef
        self._param_vars = _templates(params)
        self._state_vars = _templates(rest)
        self._key_impls = _key_impls(rest)
        self._set_annotations(
            {
                "/".join(map(path_key, path)): tuple(var.get_metadata()["out_sharding"])
                for path, var in self._param_vars
                if var.get_metadata().get("out_sharding")
            }
        )
        return _values(params), _encode(_values(rest))

    # ------------------------------------------------------------------------------ step

    def merge(self, params: Any, model_state: Any) -> nnx.Module:
        """The module for `params` and `model_state` (while tracing; after ``init``)."""
        if self._graphdef is None:
            raise RuntimeError("NNXTask: initialise the model first")
        state = _decode(model_state, self._key_impls)
        flat = [(p, v.replace(_at(params, p))) for p, v in self._param_vars]
        flat += [(p, v.replace(_at(state, p))) for p, v in self._state_vars]
        return nnx.merge(self._graphdef, nnx.from_flat_state(flat))

    def loss_with_state(
        self,
        params: Any,
        model_state: Any,
        batch: Batch,
        rng: jax.Array,
        *,
        train: bool = True,
    ) -> tuple[jax.Array, dict, Any]:
        """The loss of the model on `batch`, its aux metrics and the new model state.

        Args:
          params, model_state: as `init_with_state` returned them (updated by training).
          batch: a batch with the ``inputs`` and ``targets`` keys.
          rng: the step's key (per shard); dropout keys are drawn from it.
          train: training mode (``module.train()``), else evaluation mode (``eval()``).

        Returns:
          (mean loss, aux metrics, new model state).
        """
        module = self.merge(params, model_state)
        module.train() if train else module.eval()
        axes = manual_axes()
        if self.sync_batch_norm and axes:
            for _, sub in nnx.iter_modules(module):
                if isinstance(sub, nnx.BatchNorm) and sub.axis_name is None:
                    sub.axis_name = axes  # type: ignore[assignment]  # flax: str only; a tuple works
        keys = _use_step_keys(module, rng)
        outputs = module(self.model_inputs(batch))
        for var, key in keys:  # the model's own keys stay; only the counters advance
            var.set_value(key)
        loss, aux = self._loss_of(outputs, batch)
        _, rest = nnx.split(module, nnx.Param, ...)[1:]  # type: ignore[misc]  # as in init
        return loss, aux, _encode(_values(rest))


# ----------------------------------------------------------------------------------------
# State <-> nested dicts of arrays
# ----------------------------------------------------------------------------------------


def _takes(factory: Callable[..., Any]) -> Callable[[str], bool]:
    """Whether `factory` takes a keyword argument of a name (any, with ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: give it nothing
        return lambda name: False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda name: True
    return lambda name: name in params


def _templates(state: nnx.State) -> list[tuple[tuple, nnx.Variable]]:
    """The variables of `state` by path, their values replaced by shapes (no tracers kept)."""
    return [
        (path, var.replace(jax.ShapeDtypeStruct(jnp.shape(var.get_value()), var.get_value().dtype)))
        for path, var in nnx.to_flat_state(state)
    ]


def _values(state: nnx.State) -> dict:
    """The values of `state` as nested dicts with string keys."""
    return nested((tuple(map(path_key, p)), v.get_value()) for p, v in nnx.to_flat_state(state))


def _at(tree: Mapping, path: tuple) -> Any:
    for key in path:
        tree = tree[path_key(key)]
    return tree


def _encode(tree: Any) -> Any:
    """RNG keys as their raw uint32 data (what a checkpoint can hold)."""
    return jax.tree.map(
        lambda x: (
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        tree,
    )


def _decode(tree: Any, impls: Mapping[tuple, Any]) -> Any:
    """`_encode`'s inverse: key data back into keys at the paths of `impls`."""
    out = jax.tree.map(lambda x: x, tree)
    for path, impl in impls.items():
        node = out
        for key in path[:-1]:
            node = node[path_key(key)]
        node[path_key(path[-1])] = jax.random.wrap_key_data(node[path_key(path[-1])], impl=impl)
    return out


def _key_impls(state: nnx.State) -> dict[tuple, Any]:
    """``{path: PRNG implementation}`` of the RNG keys in `state`."""
    return {
        path: jax.random.key_impl(var.get_value())
        for path, var in nnx.to_flat_state(state)
        if jax.dtypes.issubdtype(var.get_value().dtype, jax.dtypes.prng_key)
    }


def _use_step_keys(module: nnx.Module, rng: jax.Array) -> list[tuple[nnx.Variable, Any]]:
    """Points every RNG stream of `module` at a key from the step's `rng`; returns the
    replaced key variables with their own keys, to be put back after the forward pass."""
    replaced: list[tuple[nnx.Variable, Any]] = []
    keys = (v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.RngKey))
    for i, var in enumerate(keys):
        replaced.append((var, var.get_value()))
        var.set_value(jax.random.fold_in(rng, i))
    return replaced
