"""Causal multi-head self-attention; heads are the unit of tensor parallelism."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.axes import constrain, param
from jaxpar.model.layers import rotary


class Attention(nnx.Module):
    """Fused Q/K/V projection split by heads (column-parallel), output projection by rows."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H = cfg.d_model, cfg.n_heads
        K = D // H
        # Q, K and V fused in one weight (its Q dimension: the q/k/v slot): one matmul, and in backward
        # one all-reduce of dx.
        self.w_qkv = param(rngs.params(), (D, 3, H, K), ("embed", None, "heads", "kv"), D ** -0.5)
        # GPT-2 style: residual projections scaled down with depth.
        self.wo = param(rngs.params(), (H, K, D), ("heads", "kv", "embed"), D ** -0.5 / math.sqrt(2 * cfg.n_layers))
        self.use_rope = cfg.positions == "rope"

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        names = ("batch", "seq", "heads", "kv")
        qkv_BLQHK = jnp.einsum("BLD,DQHK->BLQHK", x_BLD, self.w_qkv[...])
        q_BLHK, k_BLHK, v_BLHK = (constrain(qkv_BLQHK[:, :, i], names) for i in range(3))
        if self.use_rope:
            q_BLHK, k_BLHK = rotary(q_BLHK), rotary(k_BLHK)
        L, K = x_BLD.shape[1], q_BLHK.shape[-1]
        logits_BHLP = jnp.einsum("BLHK,BPHK->BHLP", q_BLHK, k_BLHK).astype(jnp.float32) / math.sqrt(K)
        causal_LP = jnp.tril(jnp.ones((L, L), dtype=bool))
        logits_BHLP = jnp.where(causal_LP, logits_BHLP, jnp.finfo(jnp.float32).min)
        probs_BHLP = jax.nn.softmax(logits_BHLP, axis=-1).astype(x_BLD.dtype)
        out_BLHK = constrain(jnp.einsum("BHLP,BPHK->BLHK", probs_BHLP, v_BLHK), names)
        return constrain(jnp.einsum("BLHK,HKD->BLD", out_BLHK, self.wo[...]), ("batch", "seq", "embed"))
