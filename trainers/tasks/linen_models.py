"""Example Flax linen models for ``task=flax_linen`` (your own model is configured the same way).

Their parameters carry logical axis names (``nn.with_logical_partitioning``), which the task
maps to mesh axes with ``task.logical_axis_rules``. They have Flax's ``dtype`` / ``param_dtype``
fields and a ``remat`` policy name (``nn.remat`` of each layer), which the task sets from the
run's ``precision`` and ``trainer.remat``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainers.tasks.nnx_models import ACTIVATIONS
from trainers.tasks.remat import checkpoint_policy


class MLP(nn.Module):
    """The linen twin of `trainers.tasks.nnx_models.MLP`.

    Param paths: ``layers_<i>/kernel`` (logical axes ``embed, mlp`` for hidden layers, ``mlp,
    embed`` for the output layer), ``layers_<i>/bias``, ``norms_<i>/{scale,bias}`` with
    ``batch_norm`` (whose statistics are the ``batch_stats`` collection).

    Attributes:
      hidden: hidden layer sizes.
      out_dim: output features.
      activation: "gelu", "tanh" or "relu".
      batch_norm: a BatchNorm after each hidden Dense.
      dropout: dropout rate after each hidden activation (0: none).
      dtype: the computation's dtype (None: that of the inputs and params).
      param_dtype: the params' dtype.
      remat: a ``trainer.remat`` policy name: each Dense is rematerialised (``nn.remat``).
    """

    hidden: Sequence[int] = (64, 64)
    out_dim: int = 4
    activation: str = "gelu"
    batch_norm: bool = False
    dropout: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        init = nn.initializers.lecun_normal()
        sizes = [*self.hidden, self.out_dim]
        dense = nn.Dense
        if self.remat != "none":
            dense = nn.remat(nn.Dense, policy=checkpoint_policy(self.remat))
        for i, size in enumerate(sizes):
            last = i == len(sizes) - 1
            x = dense(
                size,
                kernel_init=nn.with_logical_partitioning(
                    init, ("mlp", "embed") if last else ("embed", "mlp")
                ),
                bias_init=nn.with_logical_partitioning(
                    nn.initializers.zeros_init(), (None,) if last else ("mlp",)
                ),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=f"layers_{i}",
            )(x)
            if not last:
                if self.batch_norm:
                    x = nn.BatchNorm(
                        use_running_average=not train,
                        dtype=self.dtype,
                        param_dtype=self.param_dtype,
                        name=f"norms_{i}",
                    )(x)
                x = act(x)
                if self.dropout:
                    x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return x
