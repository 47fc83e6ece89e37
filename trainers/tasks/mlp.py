"""task=mlp: teacher-student regression with a small MLP, in pure JAX. Fast; used by most tests.

A fixed random teacher MLP (drawn from `teacher_seed`) maps x ~ N(0, I) to y; the student MLP
is trained on the mean squared error. Data is synthetic and a pure function of (seed, step).

Params: `{"layers": [{"w": (fan_in, fan_out), "b": (fan_out,)}, ...]}`, i.e. paths
"layers/0/w", "layers/0/b", ... Over a `model` mesh axis the hidden layers are column-parallel
and the output layer row-parallel; on a mesh without `model` everything is replicated.

Reliability-test hooks: `nan_at_step` (a step or a list of steps) puts a NaN in row 0 of the
global batch at those data steps (so exactly one data shard sees a non-finite gradient; the
batch of data step s makes update s + 1); `num_examples` makes the data finite.

Your own data instead of the teacher's: ``task.data.path=my.npz`` with arrays ``x``
(n, in_dim) and ``y`` (n, out_dim) (or ``task.data.keys={x: features, y: labels}``), read in
shuffled epochs (`trainers.data.files`, docs/tasks.md "Data options").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from trainers.config.precision import check_remat
from trainers.config.run import check_seed
from trainers.data.batch import Batch
from trainers.data.step_indexed import StepIndexedData, StepIndexedEvalData
from trainers.tasks.args import non_negative_number, positive_int, positive_ints
from trainers.tasks.base import Params
from trainers.tasks.remat import remat as remat_layer

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
}


def _dense(layer: Params, h: Any) -> Any:
    """One layer's affine map: ``h @ w + b``."""
    return h @ layer["w"] + layer["b"]


def _teacher(
    seed: int, in_dim: int, hidden: Sequence[int], out_dim: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Draws the teacher's (w, b) layers in NumPy; scaled so that y has roughly unit variance."""
    rng = np.random.default_rng(seed)
    dims = [in_dim, *hidden, out_dim]
    return [
        (rng.standard_normal((a, b)) / np.sqrt(a), 0.1 * rng.standard_normal(b))
        for a, b in zip(dims[:-1], dims[1:])
    ]


def _teacher_apply(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """The teacher's forward pass (tanh hidden layers), in float64 NumPy."""
    h = x
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.tanh(h) * 1.6  # ~unit-variance activations
    return h


def _steps(value: Any) -> frozenset[int]:
    """`task.nan_at_step` as a set of steps: null, one integer or a list of integers."""
    values = [] if value is None else [value] if isinstance(value, Integral) else value
    if isinstance(values, str | bytes) or not all(
        isinstance(v, Integral) and not isinstance(v, bool) and int(v) >= 0 for v in values
    ):
        raise ValueError(
            f"task.nan_at_step={value!r}: expected null, a step >= 0 or a list of steps."
        )
    return frozenset(int(v) for v in values)


#: Tags the eval split's random streams: ``[EVAL_STREAM, teacher_seed, index]`` never equals a
#: training stream ``[seed, step]`` (a different length), so eval data is held out.
EVAL_STREAM = 0x5EED_E7A1


class MLPTask(StepIndexedData, StepIndexedEvalData):
    """Teacher-student MLP regression.

    The eval split is endless held-out data from the same teacher (other random streams than
    training), without noise and without `nan_at_step`; it does not depend on the run's seed,
    so the runs of a seed sweep are evaluated on the same data.

    Args:
      in_dim: input dimension (x ~ N(0, I)).
      hidden: hidden sizes of the student MLP.
      out_dim: output dimension.
      activation: the student's activation, one of "gelu", "tanh", "relu".
      teacher_hidden: hidden sizes of the teacher MLP (tanh activations).
      teacher_seed: seed of the teacher's weights (fixed, independent of the run seed).
      noise_std: standard deviation of Gaussian noise added to the targets.
      nan_at_step: a data step, or a list of them, at which x has a NaN in row 0 of the global
        batch (the batch of data step s is used by update s + 1); null: never.
      num_examples: if set, the dataset is finite: `num_examples // global_batch_size` steps.
      data: the ``task.data`` node (`trainers.config.data.DataOptions`): with a ``path``, train
        on that file's ``x`` and ``y`` instead of the teacher's synthetic data.
      remat: the rematerialisation policy of each layer (``trainer.remat``; "none": keep
        every activation).
      name: the task's name (for logging; not used otherwise).
    """

    def __init__(
        self,
        in_dim: int = 16,
        hidden: Sequence[int] = (64, 64),
        out_dim: int = 4,
        activation: str = "gelu",
        teacher_hidden: Sequence[int] = (32,),
        teacher_seed: int = 1234,
        noise_std: float = 0.0,
        nan_at_step: int | Sequence[int] | None = None,
        num_examples: int | None = None,
        data: Any = None,
        remat: str = "none",
        name: str = "mlp",
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"task.activation={activation!r} is not supported; allowed: {sorted(ACTIVATIONS)}"
            )
        if num_examples is not None and num_examples <= 0:
            raise ValueError(f"task.num_examples must be positive or null, got {num_examples}")
        self.in_dim = positive_int(in_dim, "task.in_dim")
        self.hidden = positive_ints(hidden, "task.hidden")
        self.out_dim = positive_int(out_dim, "task.out_dim")
        self.activation = activation
        self.teacher_hidden = positive_ints(teacher_hidden, "task.teacher_hidden")
        self.teacher_seed = check_seed(teacher_seed, "task.teacher_seed")
        self.noise_std = non_negative_number(noise_std, "task.noise_std")
        self.nan_steps = _steps(nan_at_step)
        self.num_examples = None if num_examples is None else int(num_examples)
        self.name = name
        self.remat = check_remat(remat, "task.remat")
        self.data = self._file_data(data)
        # Megatron-style over `model`: hidden layers column-parallel, output layer row-parallel.
        n = len(self.hidden)
        self.sharding_rules: list[tuple[str, P]] = [
            (rf"layers/{n}/w", P("model", None)),
            (r"layers/\d+/w", P(None, "model")),
            (rf"layers/{n}/b", P()),
            (r"layers/\d+/b", P("model")),
        ]

    @functools.cached_property
    def _teacher_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The teacher, drawn when data is first made (after the run's memory check)."""
        return _teacher(self.teacher_seed, self.in_dim, self.teacher_hidden, self.out_dim)

    def example_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes of one example (the run checks its memory from them, before any data)."""
        return {
            "x": jax.ShapeDtypeStruct((self.in_dim,), np.float32),
            "y": jax.ShapeDtypeStruct((self.out_dim,), np.float32),
        }

    # ---------------------------------------------------------------------------------------
    # Model.
    # ---------------------------------------------------------------------------------------

    def init(self, rng: jax.Array, batch: Batch) -> Params:
        """Returns LeCun-normal weights and zero biases.

        Args:
          rng: a PRNG key.
          batch: an example batch; only the shape of `batch["x"]` is checked.

        Returns:
          `{"layers": [{"w": ..., "b": ...}, ...]}` in float32.
        """
        if np.shape(batch["x"])[-1] != self.in_dim:
            raise ValueError(
                f"batch x has shape {np.shape(batch['x'])}, expected last dim task.in_dim="
                f"{self.in_dim}"
            )
        dims = [self.in_dim, *self.hidden, self.out_dim]
        keys = jax.random.split(rng, len(dims) - 1)
        layers = [
            {
                "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
                "b": jnp.zeros((b,), jnp.float32),
            }
            for k, a, b in zip(keys, dims[:-1], dims[1:])
        ]
        return {"layers": layers}

    def apply(self, params: Params, x: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
        """The student's forward pass: x (batch, in_dim) -> (batch, out_dim), in the params'
        dtype (the input is cast to it; the trainer casts the params to
        ``precision.compute_dtype``), each layer rematerialised with ``remat``."""
        act = ACTIVATIONS[self.activation]
        layers = params["layers"]
        dense = remat_layer(_dense, self.remat)
        h = x.astype(layers[0]["w"].dtype)
        for i, layer in enumerate(layers):
            h = dense(layer, h)
            if i < len(layers) - 1:
                h = act(h)
        return h

    def loss(self, params: Params, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict]:
        """Mean squared error over the batch and output dims.

        Args:
          params: the student's params.
          batch: `{"x": (n, in_dim), "y": (n, out_dim)}`.
          rng: unused (the model is deterministic).

        Returns:
          (mse, {"mse": mse}).
        """
        del rng
        outputs = self.apply(params, batch["x"]).astype(jnp.float32)
        mse = jnp.mean(jnp.square(outputs - batch["y"]))
        return mse, {"mse": mse}

    # ---------------------------------------------------------------------------------------
    # Data.
    # ---------------------------------------------------------------------------------------

    def _file_data(self, node: Any) -> Any:
        """`ArrayData` of the ``task.data`` file, or None for the teacher's data."""
        from trainers.data.files import Field, file_examples

        data = file_examples(
            node,
            {
                "x": Field((self.in_dim,), "float32", f"task.in_dim={self.in_dim}"),
                "y": Field((self.out_dim,), "float32", f"task.out_dim={self.out_dim}"),
            },
            task=f"task={self.name}",
        )
        if data is not None and (self.num_examples is not None or self.nan_steps):
            raise ValueError(
                "task.num_examples and task.nan_at_step shape the synthetic data; with "
                "task.data.path set them to null (task.data.num_epochs makes file data finite)."
            )
        return data

    def batches(self, global_batch_size: int, **kwargs: Any) -> Iterator[Batch]:
        """This process's batches: from the ``task.data`` file if set, else synthetic.

        Args and Returns as `StepIndexedData.batches` (keyword arguments passed on).
        """
        if self.data is not None:
            return self.data.batches(global_batch_size, **kwargs)
        return super().batches(global_batch_size, **kwargs)

    def num_data_steps(self, global_batch_size: int) -> int | None:
        """`num_examples // global_batch_size` steps when `num_examples` is set, else None."""
        if self.data is not None:
            return self.data.num_data_steps(global_batch_size)
        return None if self.num_examples is None else self.num_examples // global_batch_size

    def global_batch(self, global_batch_size: int, *, seed: int, step: int) -> Batch:
        """The whole global batch at `step`: a pure function of (seed, step).

        Args:
          global_batch_size: rows.
          seed: the data seed.
          step: the training step.

        Returns:
          `{"x": float32 (n, in_dim), "y": float32 (n, out_dim)}`.
        """
        rng = np.random.default_rng([seed, step])
        x = rng.standard_normal((global_batch_size, self.in_dim))
        y = _teacher_apply(self._teacher_layers, x)
        if self.noise_std:
            y = y + self.noise_std * rng.standard_normal(y.shape)
        x = x.astype(np.float32)
        if step in self.nan_steps:
            x[0, 0] = np.nan
        return {"x": x, "y": y.astype(np.float32)}

    @property
    def has_eval_split(self) -> bool:
        """Whether the teacher's held-out data is this run's eval split: not for a run on the
        examples of ``task.data.path`` (the teacher did not make them)."""
        return self.data is None

    def global_eval_batch(self, global_batch_size: int, *, seed: int, index: int) -> Batch:
        """Held-out global eval batch `index`: fresh inputs, the teacher's noiseless targets.

        Args:
          global_batch_size: rows.
          seed: unused: the eval set is the same for every run seed.
          index: the eval batch's number (0, 1, ... in every evaluation).

        Returns:
          `{"x": float32 (n, in_dim), "y": float32 (n, out_dim)}`.
        """
        del seed
        rng = np.random.default_rng([EVAL_STREAM, self.teacher_seed, index])
        x = rng.standard_normal((global_batch_size, self.in_dim))
        y = _teacher_apply(self._teacher_layers, x)
        return {"x": x.astype(np.float32), "y": y.astype(np.float32)}
