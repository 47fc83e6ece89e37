"""The model: a small Flax NNX MLP whose kernels carry logical axis names.

The names (``embed``, ``mlp``) are mapped to mesh axes by ``task.logical_axis_rules`` in
conf/task/regression.yaml, so the sharding lives in config, not in the model.
"""

from __future__ import annotations

from flax import nnx


class MLP(nnx.Module):
    """``in_dim -> hidden -> ... -> out_dim`` with GELU and LayerNorm.

    Args:
      in_dim: input features.
      hidden: width of the hidden layers.
      depth: number of hidden layers (>= 1).
      out_dim: outputs.
      rngs: the init keys (the task passes them).
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int = 1, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.inp = nnx.Linear(
            in_dim, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.blocks = nnx.List(
            [
                nnx.Linear(
                    hidden,
                    hidden,
                    kernel_init=nnx.with_partitioning(init, (None, "mlp")),
                    rngs=rngs,
                )
                for _ in range(depth - 1)
            ]
        )
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(
            hidden, out_dim, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):
        """The model's outputs for a batch of inputs ``x`` of shape (batch, in_dim)."""
        h = nnx.gelu(self.inp(x))
        for block in self.blocks:
            h = h + nnx.gelu(block(h))
        return self.out(self.norm(h))
