"""task=tiny_gpt: a small byte-level decoder-only transformer in pure JAX.

Token + learned positional embeddings, `n_layers` pre-LayerNorm blocks (causal multi-head
self-attention, GELU MLP), a final LayerNorm and a tied (or untied) output projection, trained
on next-byte prediction over the stdlib-docstring corpus (`trainers.tasks.corpus`).

Param paths (LayerNorm params are named "scale"/"bias" so weight-decay masks can skip them):

    embed/tokens (vocab, d)      embed/positions (seq_len, d)
    blocks/<i>/ln1/{scale,bias}  blocks/<i>/attn/{wq,wk,wv,wo} (d, d)
    blocks/<i>/ln2/{scale,bias}  blocks/<i>/mlp/{w1 (d, ff), b1 (ff), w2 (ff, d), b2 (d)}
    ln_f/{scale,bias}            head/w (d, vocab)  [only if tie_embeddings is false]

Sharding over a `model` axis is Megatron-style: q/k/v and w1 split by columns (heads / hidden
units), wo and w2 by rows, so each block needs one reduction after attention and one after the
MLP; embeddings are split along d_model.

The block's math is `trainers.tasks.gpt_layers`; the corpus windows, training and held-out,
are `trainers.tasks.corpus_windows.CorpusWindows`; this module is the task: its config, params,
forward pass, loss and a sampling demo.

Precision and memory: the model computes in the dtype of the params it is given (the trainer
casts them to ``precision.compute_dtype``), with LayerNorm statistics, the attention softmax
and the logits in float32. ``remat`` (``${trainer.remat}`` in its node) rematerialises each
block with that policy (`trainers.tasks.remat`).

Your own text instead of the corpus: ``task.data.path=my.txt`` (bytes as tokens) or a 1-D
``.npy`` of token ids, cut into windows of ``seq_len + 1`` tokens read in shuffled epochs
(`trainers.data.files`, docs/tasks.md "Data options").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from trainers.config.precision import check_remat
from trainers.data.batch import Batch
from trainers.tasks import corpus
from trainers.tasks.args import non_negative_number, positive_int
from trainers.tasks.base import Params
from trainers.tasks.corpus_windows import CorpusWindows
from trainers.tasks.gpt_layers import block, layer_norm
from trainers.tasks.remat import remat as remat_layer

#: Megatron-style rules over the `model` axis (dropped on meshes without it).
SHARDING_RULES: tuple[tuple[str, P], ...] = (
    (r"blocks/\d+/attn/w[qkv]", P(None, "model")),
    (r"blocks/\d+/attn/wo", P("model", None)),
    (r"blocks/\d+/mlp/w1", P(None, "model")),
    (r"blocks/\d+/mlp/b1", P("model")),
    (r"blocks/\d+/mlp/w2", P("model", None)),
    (r"embed/(tokens|positions)", P(None, "model")),
    (r"head/w", P(None, "model")),
)


# --------------------------------------------------------------------------------------------
# The task.
# --------------------------------------------------------------------------------------------


class TinyGPTTask(CorpusWindows):
    """Next-byte prediction with a small decoder-only transformer.

    The last `eval_fraction` of the corpus is held out: training windows come from the rest,
    the eval split is that tail cut into consecutive windows of ``seq_len`` predicted tokens
    (the same in every evaluation), each scored once (the last eval batch is padded and
    masked); the tail's last ``< seq_len`` tokens, too few for a window, are not scored.

    Args:
      vocab_size: number of token ids; byte-level, so >= 128 (the corpus is ASCII).
      d_model: width of the residual stream.
      n_heads: attention heads; must divide `d_model`.
      n_layers: transformer blocks.
      d_ff: hidden units of the MLPs.
      seq_len: tokens per training sequence (also the size of the positional table).
      tie_embeddings: if true, the output projection is the transposed token embedding.
      init_std: standard deviation of the normal weight init (GPT-2: 0.02); the residual
        output projections (wo, w2) are further scaled by 1 / sqrt(2 * n_layers).
      corpus_max_chars: cap on the corpus size in characters.
      data: the ``task.data`` node (`trainers.config.data.DataOptions`): with a ``path``, train
        on that file's tokens instead of the corpus.
      eval_fraction: the fraction of the corpus (its end) held out for evaluation, in
        [0, 0.5]; 0: no eval split.
      remat: the rematerialisation policy of each block (``trainer.remat``; "none": keep
        every activation).
      name: the task's name (for logging; not used otherwise).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int = 256,
        seq_len: int = 64,
        tie_embeddings: bool = True,
        init_std: float = 0.02,
        corpus_max_chars: int = corpus.DEFAULT_MAX_CHARS,
        data: Any = None,
        eval_fraction: float = 0.1,
        remat: str = "none",
        name: str = "tiny_gpt",
    ):
        sizes = dict(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
        sizes.update(d_ff=d_ff, seq_len=seq_len, corpus_max_chars=corpus_max_chars)
        for key, value in sizes.items():
            positive_int(value, f"task.{key}")
        from trainers.data.files import file_tokens

        self.data = file_tokens(data, seq_len=seq_len, vocab_size=vocab_size, task=f"task={name}")
        if self.data is None and vocab_size < 128:
            raise ValueError(f"task.vocab_size={vocab_size} must be >= 128 (ASCII byte tokens)")
        if d_model % n_heads:
            raise ValueError(f"task.d_model={d_model} is not divisible by task.n_heads={n_heads}")
        self.vocab_size = int(vocab_size)
        self.d_model = int(d_model)
        self.n_heads = int(n_heads)
        self.n_layers = int(n_layers)
        self.d_ff = int(d_ff)
        self.seq_len = int(seq_len)
        self.tokens_per_example = self.seq_len  # predicted per sequence (perf/tokens_per_sec)
        self.tie_embeddings = bool(tie_embeddings)
        self.init_std = non_negative_number(init_std, "task.init_std")
        self.corpus_max_chars = int(corpus_max_chars)
        self.name = name
        self.remat = check_remat(remat, "task.remat")
        self.sharding_rules: list[tuple[str, P]] = list(SHARDING_RULES)
        if self.data is None and len(self.tokens) < self.seq_len + 2:
            raise ValueError(
                f"corpus has {len(self.tokens)} tokens, too few for task.seq_len={seq_len}"
            )
        self._set_eval_split(eval_fraction)
        self._sample_step: Callable[..., Any] | None = None

    def _set_eval_split(self, eval_fraction: Any) -> None:
        """Sets ``eval_fraction`` and ``eval_start`` (tokens before it are for training; the
        rest is the eval split) from ``task.eval_fraction``.

        Raises:
          ValueError: naming the key, for a fraction outside [0, 0.5] or one that leaves too
            few tokens for a window on either side.
        """
        if (
            isinstance(eval_fraction, bool)
            or not isinstance(eval_fraction, int | float)
            or not 0 <= eval_fraction <= 0.5
        ):
            raise ValueError(
                f"task.eval_fraction={eval_fraction!r}: expected a number in [0, 0.5]."
            )
        self.eval_fraction = float(eval_fraction)
        #: Tokens before this index are for training; the rest is the eval split.
        self.eval_start = len(self.tokens) - int(len(self.tokens) * self.eval_fraction)
        if self.data is None and self.eval_start < self.seq_len + 2:
            raise ValueError(
                f"task.eval_fraction={eval_fraction} leaves {self.eval_start} training tokens, "
                f"too few for task.seq_len={self.seq_len}"
            )
        if self.has_eval_split and self._eval_windows() == 0:
            raise ValueError(
                f"task.eval_fraction={eval_fraction} holds out "
                f"{len(self.tokens) - self.eval_start} tokens, fewer than one window of "
                f"task.seq_len={self.seq_len} + 1; use a larger fraction, or 0 for no eval split"
            )

    # ---------------------------------------------------------------------------------------
    # Model.
    # ---------------------------------------------------------------------------------------

    def init(self, rng: jax.Array, batch: Batch) -> Params:
        """Returns freshly initialised params (float32).

        Args:
          rng: a PRNG key.
          batch: an example batch; `batch["inputs"]` must have at most `seq_len` columns.

        Returns:
          The nested param dict described in the module docstring.
        """
        if np.shape(batch["inputs"])[-1] > self.seq_len:
            raise ValueError(
                f"batch inputs have shape {np.shape(batch['inputs'])}, longer than "
                f"task.seq_len={self.seq_len}"
            )
        d, ff, std = self.d_model, self.d_ff, self.init_std
        out_std = std / math.sqrt(2 * self.n_layers)
        keys = iter(jax.random.split(rng, 3 + 6 * self.n_layers))
        normal = lambda shape, s=std: s * jax.random.normal(next(keys), shape)
        ln = lambda: {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}
        params: Params = {
            "embed": {
                "tokens": normal((self.vocab_size, d)),
                "positions": normal((self.seq_len, d)),
            },
            "blocks": [
                {
                    "ln1": ln(),
                    "attn": {
                        "wq": normal((d, d)),
                        "wk": normal((d, d)),
                        "wv": normal((d, d)),
                        "wo": normal((d, d), out_std),
                    },
                    "ln2": ln(),
                    "mlp": {
                        "w1": normal((d, ff)),
                        "b1": jnp.zeros((ff,)),
                        "w2": normal((ff, d), out_std),
                        "b2": jnp.zeros((d,)),
                    },
                }
                for _ in range(self.n_layers)
            ],
            "ln_f": ln(),
        }
        if not self.tie_embeddings:
            params["head"] = {"w": normal((d, self.vocab_size))}
        return params

    def apply(self, params: Params, inputs: jax.Array | np.ndarray) -> jax.Array:
        """Returns next-token logits.

        Args:
          params: the model's params.
          inputs: int tokens of shape (batch, t), t <= seq_len.

        Returns:
          float32 logits of shape (batch, t, vocab_size), computed in the params' dtype.
        """
        t = inputs.shape[-1]
        x = params["embed"]["tokens"][inputs] + params["embed"]["positions"][:t]
        layer = remat_layer(functools.partial(block, n_heads=self.n_heads), self.remat)
        for p in params["blocks"]:
            x = layer(p, x)
        x = layer_norm(params["ln_f"], x)
        head = params["embed"]["tokens"].T if self.tie_embeddings else params["head"]["w"]
        return (x @ head).astype(jnp.float32)

    def loss(self, params: Params, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy over all positions of the batch.

        Args:
          params: the model's params.
          batch: `{"inputs": int32 (n, t), "targets": int32 (n, t)}`.
          rng: unused (no dropout).

        Returns:
          (mean cross-entropy in nats, {"accuracy": token accuracy}).
        """
        del rng
        logits = self.apply(params, batch["inputs"])
        targets = batch["targets"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))
        return jnp.mean(nll), {"accuracy": accuracy}

    # ---------------------------------------------------------------------------------------
    # Demo.
    # ---------------------------------------------------------------------------------------

    def sample(
        self,
        params: Params,
        prompt: str,
        n: int,
        *,
        rng: jax.Array | None = None,
        temperature: float = 1.0,
    ) -> str:
        """Continues `prompt` by `n` sampled characters (greedy if `rng` is None).

        Recomputes the full window for every token (no KV cache): fine for a short demo.

        Args:
          params: the model's params.
          prompt: text to continue (normalised to ASCII; may be empty).
          n: number of characters to generate.
          rng: PRNG key for sampling; None decodes greedily.
          temperature: softmax temperature when sampling.

        Returns:
          The `n` generated characters (without the prompt).
        """
        if self._sample_step is None:
            self._sample_step = jax.jit(self._next_token)
        context = list(corpus.encode(prompt)) or [ord("\n")]
        out = []
        for i in range(n):
            window = context[-self.seq_len :]
            buf = np.zeros((1, self.seq_len), np.int32)
            buf[0, : len(window)] = window
            key = jax.random.fold_in(rng, i) if rng is not None else None
            token = int(self._sample_step(params, buf, len(window), key, temperature))
            context.append(token)
            out.append(token)
        return corpus.decode(out)

    def _next_token(self, params, buf, length, key, temperature):
        """The next token after `buf[0, :length]` (causal, so the padding does not matter)."""
        logits = self.apply(params, buf)[0, length - 1]
        if key is None:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)
