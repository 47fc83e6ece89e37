"""Example Flax NNX models for ``task=flax_nnx`` (your own model is configured the same way).

Their parameters carry logical axis names (``nnx.with_partitioning``), which the task maps to
mesh axes with ``task.logical_axis_rules``. They take Flax's ``dtype`` / ``param_dtype`` and a
``remat`` policy name (``nnx.remat`` of each layer), which the task passes from the run's
``precision`` and ``trainer.remat``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainers.tasks.remat import checkpoint_policy

ACTIVATIONS = {"gelu": jax.nn.gelu, "tanh": jnp.tanh, "relu": jax.nn.relu}


class MLP(nnx.Module):
    """An MLP: ``Linear -> [BatchNorm] -> activation -> [Dropout]`` per hidden layer, then a
    Linear output layer.

    Param paths: ``layers/<i>/kernel`` (logical axes ``embed, mlp`` for hidden layers, ``mlp,
    embed`` for the output layer), ``layers/<i>/bias`` (``mlp`` / none), ``norms/<i>/{scale,
    bias}`` with ``batch_norm``. With ``{embed: null, mlp: model}`` hidden layers are
    column-parallel and the output layer row-parallel over ``model``.

    Args:
      in_dim: input features.
      hidden: hidden layer sizes.
      out_dim: output features.
      activation: "gelu", "tanh" or "relu".
      batch_norm: a BatchNorm after each hidden Linear.
      dropout: dropout rate after each hidden activation (0: none).
      dtype: the computation's dtype (None: that of the inputs and params).
      param_dtype: the params' dtype.
      remat: a ``trainer.remat`` policy name: each Linear is rematerialised (``nnx.remat``).
      rngs: the module's RNG streams (given by the task).
    """

    def __init__(
        self,
        in_dim: int = 16,
        hidden: Sequence[int] = (64, 64),
        out_dim: int = 4,
        activation: str = "gelu",
        batch_norm: bool = False,
        dropout: float = 0.0,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        remat: str = "none",
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; allowed: {sorted(ACTIVATIONS)}")
        dims = [in_dim, *hidden, out_dim]
        init = nnx.initializers.lecun_normal()
        layers = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            last = i == len(dims) - 2
            layers.append(
                nnx.Linear(
                    a,
                    b,
                    kernel_init=nnx.with_partitioning(
                        init, ("mlp", "embed") if last else ("embed", "mlp")
                    ),
                    bias_init=nnx.with_partitioning(
                        nnx.initializers.zeros_init(), (None,) if last else ("mlp",)
                    ),
                    dtype=dtype,
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
            )
        self.layers = nnx.List(layers)
        self.norms = nnx.List(
            [nnx.BatchNorm(h, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for h in hidden]
            if batch_norm
            else []
        )
        self.remat = remat
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        call = _call
        if self.remat != "none":
            call = nnx.remat(_call, policy=checkpoint_policy(self.remat))
        for i, layer in enumerate(self.layers):
            x = call(layer, x)
            if i < len(self.layers) - 1:
                if len(self.norms):
                    x = self.norms[i](x)
                x = act(x)
                if self.dropout is not None:
                    x = self.dropout(x)
        return x


def _call(layer: nnx.Module, x: jax.Array) -> jax.Array:
    """``layer(x)``: what `MLP` rematerialises per layer."""
    return layer(x)
