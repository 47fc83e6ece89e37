"""The model: a small Flax NNX MLP whose kernels carry logical axis names.

The names (``embed``, ``mlp``) are mapped to mesh axes by ``task.logical_axis_rules`` in
conf/task/regression.yaml, so the sharding lives in config, not in the model. The task gives it
the run's ``precision`` (``dtype``, ``param_dtype``) and ``trainer.remat`` (the node's last
three lines).
"""

from __future__ import annotations

from flax import nnx

from trainers.tasks.remat import checkpoint_policy


class MLP(nnx.Module):
    """``in_dim -> hidden -> ... -> out_dim`` with GELU and LayerNorm.

    Args:
      in_dim: input features.
      hidden: width of the hidden layers.
      out_dim: outputs.
      depth: number of hidden layers (>= 1).
      dtype: the computation's dtype (``precision.compute_dtype``; None: the inputs').
      param_dtype: the params' dtype (``precision.param_dtype``).
      remat: ``trainer.remat``: each hidden layer is rematerialised with that policy
        (``nnx.remat``; ``none``: every activation is kept).
      rngs: the init keys (the task passes them).
    """

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int,
        depth: int = 1,
        *,
        dtype: str | None = None,
        param_dtype: str = "float32",
        remat: str = "none",
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.lecun_normal()
        common = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.inp = nnx.Linear(
            in_dim, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), **common
        )
        self.blocks = nnx.List(
            [
                nnx.Linear(
                    hidden, hidden, kernel_init=nnx.with_partitioning(init, (None, "mlp")), **common
                )
                for _ in range(depth - 1)
            ]
        )
        self.norm = nnx.LayerNorm(hidden, **common)
        self.out = nnx.Linear(
            hidden, out_dim, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), **common
        )
        self.remat = remat

    def __call__(self, x):
        """The model's outputs for a batch of inputs ``x`` of shape (batch, in_dim)."""
        layer = _layer
        if self.remat != "none":
            layer = nnx.remat(_layer, policy=checkpoint_policy(self.remat))
        h = nnx.gelu(layer(self.inp, x))
        for block in self.blocks:
            h = h + nnx.gelu(layer(block, h))
        return self.out(self.norm(h))


def _layer(linear: nnx.Linear, x):
    """``linear(x)``: a hidden layer, what ``remat`` recomputes in the backward pass."""
    return linear(x)
