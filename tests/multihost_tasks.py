"""A task for the multi-process CLI tests: an eval split each process reads from its own files.

`FilesEvalClassifier` is a linear softmax classifier. Its eval split is a few "files" of
examples of different sizes; process ``p`` of ``P`` reads files ``p, p + P, ...`` in batches
of its share of the global batch, the last one short (a process with no file has no batch).
So on two processes the processes have different numbers of examples *and* of batches (the
evaluation agrees on the most and pads), while the examples of all processes together are
the whole split, whatever the number of processes: the mean over them does not depend on it
(`numpy_reference`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainers.data.arrays import ArrayData

DIM, CLASSES = 5, 3
#: Examples per eval file (359 in all: not a multiple of any batch size the tests use).
FILES = (200, 100, 59)


def examples(n: int, seed: int) -> dict[str, np.ndarray]:
    """`n` random examples: inputs ``x`` (n, DIM) and integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return {"x": x, "label": rng.integers(0, CLASSES, n).astype(np.int32)}


def eval_file(files: Sequence[int], index: int) -> dict[str, np.ndarray]:
    """The examples of eval file `index` of files of sizes `files`."""
    return examples(files[index], 100 + index)


def numpy_reference(w: np.ndarray, b: np.ndarray, files: Sequence[int] = FILES) -> dict[str, float]:
    """Mean cross-entropy and accuracy over every eval example, in NumPy (float64)."""
    data = [eval_file(files, i) for i in range(len(files))]
    x = np.concatenate([d["x"] for d in data]).astype(np.float64)
    label = np.concatenate([d["label"] for d in data])
    logits = x @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(label)), label]
    correct = logits.argmax(axis=1) == label
    return {"eval/loss": float(loss.mean()), "eval/accuracy": float(correct.mean())}


class FilesEvalClassifier:
    """Trains on 512 random examples; evaluates on `files`, each process on its own files.

    Args:
      files: examples per eval file.
      name: the task's name (logs only).
    """

    sharding_rules: Sequence[Any] = ()

    def __init__(self, files: Sequence[int] = FILES, name: str = "files_eval"):
        self.files = tuple(int(n) for n in files)
        self.name = name
        self.train = ArrayData(examples(512, 0), name="the train split")

    def init(self, rng: jax.Array, batch: dict[str, Any]) -> dict[str, jax.Array]:
        return {"w": 0.5 * jax.random.normal(rng, (DIM, CLASSES)), "b": jnp.zeros((CLASSES,))}

    def loss(self, params: Any, batch: Any, rng: jax.Array) -> tuple[jax.Array, dict]:
        logits = batch["x"] @ params["w"] + params["b"]
        log_probs = jax.nn.log_softmax(logits)
        loss = -jnp.take_along_axis(log_probs, batch["label"][:, None], 1)[:, 0]
        correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
        return jnp.mean(loss), {"accuracy": jnp.mean(correct)}

    def batches(self, global_batch_size: int, **kwargs: Any) -> Iterator[dict[str, np.ndarray]]:
        return self.train.batches(global_batch_size, **kwargs)

    def eval_batches(
        self, global_batch_size: int, *, seed: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[dict[str, np.ndarray]]:
        """This process's files, in batches of its share of the global batch (the last short)."""
        del seed
        rows = global_batch_size // process_count
        mine = [
            eval_file(self.files, i) for i in range(process_index, len(self.files), process_count)
        ]
        if not mine:
            return iter(())
        data = {k: np.concatenate([f[k] for f in mine]) for k in ("x", "label")}
        n = len(data["label"])
        return ({k: v[i : i + rows] for k, v in data.items()} for i in range(0, n, rows))
