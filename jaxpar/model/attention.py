"""Causal self-attention with grouped-query heads; heads are the unit of tensor parallelism.

The scores can be computed three ways (`model.attention`): `dot` materialises the B x H x L x L
scores; `flash` (jaxpar.model.flash) runs blockwise with an online softmax and O(L) memory on any
backend; `cudnn` calls cuDNN's fused kernel through `jax.nn.dot_product_attention` (GPU,
bf16/fp16). `auto` picks cudnn where it runs, else flash when the sequence spans more than one
block, else dot. Scores accumulate in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.axes import column_parallel, constrain, param, row_parallel
from jaxpar.model.flash import flash_attention
from jaxpar.model.layers import rotary

HALF_PRECISION = (jnp.bfloat16, jnp.float16)


class Attention(nnx.Module):
    """Q/K/V projections split by heads (column-parallel), the output projection by rows.

    With as many key/value heads as query heads, Q, K and V share one fused weight (one matmul,
    and in backward one all-reduce of dx); with fewer (grouped-query or multi-query attention) Q
    has its own weight and K, V share one, as their head counts and shardings differ. Query head
    h reads key/value head h // (n_heads / n_kv_heads).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H, G = cfg.d_model, cfg.n_heads, cfg.kv_heads
        K = D // H
        self.fused_qkv = G == H
        if self.fused_qkv:
            self.w_qkv = param(rngs.params(), (D, 3, H, K), ("embed", None, "heads", "kv"), D ** -0.5)
        else:
            self.w_q = param(rngs.params(), (D, H, K), ("embed", "heads", "kv"), D ** -0.5)
            self.w_kv = param(rngs.params(), (D, 2, G, K), ("embed", None, "kv_heads", "kv"), D ** -0.5)
        # GPT-2 style: residual projections scaled down with depth.
        self.wo = param(rngs.params(), (H, K, D), ("heads", "kv", "embed"), D ** -0.5 / math.sqrt(2 * cfg.n_layers))
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.kernel = cfg.attention
        self.flash_blocks = cfg.flash_blocks()

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD)
        if self.rope_theta is not None:
            q_BLHK, k_BLGK = rotary(q_BLHK, self.rope_theta), rotary(k_BLGK, self.rope_theta)
        kernel = attention_kernel(self.kernel, q_BLHK.dtype, x_BLD.shape[1], self.flash_blocks)
        if kernel == "cudnn":  # takes the fewer key/value heads as they are
            out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, is_causal=True, implementation="cudnn")
        else:
            k_BLHK, v_BLHK = (repeat_kv_heads(t, q_BLHK.shape[2]) for t in (k_BLGK, v_BLGK))
            if kernel == "flash":
                out_BLHK = flash_attention(q_BLHK, k_BLHK, v_BLHK, block_q=self.flash_blocks[0],
                                           block_kv=self.flash_blocks[1])
            else:
                out_BLHK = dot_attention(q_BLHK, k_BLHK, v_BLHK)
        names, residual = ("batch", "seq", "heads", "kv"), ("batch", "residual_seq", "embed")
        out_BLHK = constrain(out_BLHK, names)
        return constrain(row_parallel("BLHK,HKD->BLD", out_BLHK, self.wo, names, residual), residual)

    def project(self, x_BLD: jax.Array):
        """q (B, L, H, K) and k, v (B, L, G, K), G the key/value heads."""
        names, kv_names = ("batch", "seq", "heads", "kv"), ("batch", "seq", "kv_heads", "kv")
        residual = ("batch", "residual_seq", "embed")
        if self.fused_qkv:
            qkv_BLQHK = column_parallel("BLD,DQHK->BLQHK", x_BLD, self.w_qkv, residual,
                                        ("batch", "seq", None, "heads", "kv"))
            return tuple(constrain(qkv_BLQHK[:, :, i], names) for i in range(3))
        q_BLHK = constrain(column_parallel("BLD,DHK->BLHK", x_BLD, self.w_q, residual, names), names)
        kv_BLQGK = column_parallel("BLD,DQGK->BLQGK", x_BLD, self.w_kv, residual, ("batch", "seq", None, "kv_heads", "kv"))
        return (q_BLHK, *(constrain(kv_BLQGK[:, :, i], kv_names) for i in range(2)))


def attention_kernel(choice: str, dtype, seq_len: int, flash_blocks: tuple[int, int]) -> str:
    """The kernel `model.attention` runs with: `auto` resolved for this backend, dtype and length."""
    if choice != "auto":
        return choice
    if jax.default_backend() == "gpu" and dtype in HALF_PRECISION:
        return "cudnn"
    return "flash" if seq_len > min(flash_blocks) else "dot"


def repeat_kv_heads(x_BLGK: jax.Array, heads: int) -> jax.Array:
    """Each key/value head repeated for the query heads that read it: (B, L, G, K) -> (B, L, H, K).
    Constrained like the query heads, so each tensor rank builds only the heads it holds."""
    groups = heads // x_BLGK.shape[2]
    x_BLHK = x_BLGK if groups == 1 else jnp.repeat(x_BLGK, groups, axis=2)
    return constrain(x_BLHK, ("batch", "seq", "heads", "kv"))


def dot_attention(q_BLHK: jax.Array, k_BPHK: jax.Array, v_BPHK: jax.Array) -> jax.Array:
    """Causal softmax(q k^T / sqrt(K)) v with the whole L x P score matrix, scores in fp32."""
    L, K = q_BLHK.shape[1], q_BLHK.shape[-1]
    scores_BHLP = jnp.einsum("BLHK,BPHK->BHLP", q_BLHK, k_BPHK, preferred_element_type=jnp.float32) / math.sqrt(K)
    causal_LP = jnp.tril(jnp.ones((L, L), dtype=bool))
    scores_BHLP = jnp.where(causal_LP, scores_BHLP, jnp.finfo(jnp.float32).min)
    probs_BHLP = jax.nn.softmax(scores_BHLP, axis=-1).astype(q_BLHK.dtype)
    return jnp.einsum("BHLP,BPHK->BLHK", probs_BHLP, v_BPHK)
