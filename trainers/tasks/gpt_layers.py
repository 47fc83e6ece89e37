"""The tiny GPT's transformer block as pure functions of its params (`trainers.tasks.tiny_gpt`).

A pre-LayerNorm block: causal multi-head self-attention, then a GELU MLP, each added to the
residual stream. Every function computes in the dtype of the params and activations it is
given, except the LayerNorm statistics and the attention scores and softmax, which are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainers.tasks.base import Params


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis with params `scale` and `bias`, computed in float32 and
    returned in `x`'s dtype."""
    y = x.astype(jnp.float32)
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(var + eps) * p["scale"].astype(jnp.float32)
    return (y + p["bias"].astype(jnp.float32)).astype(x.dtype)


def causal_attention(p: Params, x: jax.Array, n_heads: int) -> jax.Array:
    """Causal multi-head self-attention: x (b, t, d) -> (b, t, d).

    The attention itself is `jax.nn.dot_product_attention` (XLA's: scores in float32 scaled by
    ``1 / sqrt(head_dim)``, the causal mask, the softmax in float32), so a backend's fused
    kernel is one ``implementation=`` away.
    """
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, n_heads, d // n_heads)
    q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    return out @ p["wo"]


def mlp(p: Params, x: jax.Array) -> jax.Array:
    """The GELU MLP of a block: x (..., d) -> (..., d)."""
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def block(p: Params, x: jax.Array, n_heads: int) -> jax.Array:
    """One pre-LN transformer block."""
    x = x + causal_attention(p["attn"], layer_norm(p["ln1"], x), n_heads)
    return x + mlp(p["mlp"], layer_norm(p["ln2"], x))
