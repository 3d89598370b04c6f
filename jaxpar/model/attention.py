"""Causal self-attention with grouped-query heads; heads are the unit of tensor parallelism.

The scores can be computed three ways (`model.attention`): `dot` materialises the B x H x L x L
scores; `flash` (jaxpar.model.flash) runs blockwise with an online softmax and O(L) memory on any
backend; `cudnn` calls cuDNN's fused kernel through `jax.nn.dot_product_attention` (GPU,
bf16/fp16). `auto` picks cudnn where it runs, else flash when the sequence spans more than one
block, else dot. Scores accumulate in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.adapters import adapters, lora_output, with_lora
from jaxpar.model.axes import (
    column_parallel,
    constrain,
    context_attention,
    fp32_einsum,
    param,
    row_parallel,
    zeros_param,
)
from jaxpar.model.flash import flash_attention
from jaxpar.model.layers import RMSNorm, rope_frequencies, rotary
from jaxpar.model.segments import Segments

HALF_PRECISION = (jnp.bfloat16, jnp.float16)


class Attention(nnx.Module):
    """Q/K/V projections split by heads (column-parallel), the output projection by rows.

    With as many key/value heads as query heads, Q, K and V share one fused weight (one matmul,
    and in backward one all-reduce of dx); with fewer (grouped-query or multi-query attention) Q
    has its own weight and K, V share one, as their head counts and shardings differ. Query head
    h reads key/value head h // (n_heads / n_kv_heads). Optional: biases on Q, K and V
    (`model.qkv_bias`), and an RMSNorm of each query and key head before the rotation
    (`model.qk_norm`).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, local: bool = False):
        D, H, G, K = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.fused_qkv = G == H
        if self.fused_qkv:
            self.w_qkv = param(rngs.params(), (D, 3, H, K), ("embed", None, "heads", "kv"), D ** -0.5)
            self.b_qkv = zeros_param((3, H, K), (None, "heads", "kv")) if cfg.qkv_bias else None
        else:
            self.w_q = param(rngs.params(), (D, H, K), ("embed", "heads", "kv"), D ** -0.5)
            self.w_kv = param(rngs.params(), (D, 2, G, K), ("embed", None, "kv_heads", "kv"), D ** -0.5)
            self.b_q = zeros_param((H, K), ("heads", "kv")) if cfg.qkv_bias else None
            self.b_kv = zeros_param((2, G, K), (None, "kv_heads", "kv")) if cfg.qkv_bias else None
        self.q_norm = RMSNorm(K, cfg.norm_eps, ("kv",)) if cfg.qk_norm else None
        self.k_norm = RMSNorm(K, cfg.norm_eps, ("kv",)) if cfg.qk_norm else None
        # GPT-2 style: residual projections scaled down with depth.
        self.wo = param(rngs.params(), (H, K, D), ("heads", "kv", "embed"),
                        (H * K) ** -0.5 / math.sqrt(2 * cfg.n_layers))
        q_out, kv_out = ((H, K), ("heads", "kv")), ((G, K), ("kv_heads", "kv"))
        projection = lambda out: (((), (D,), out[0]), ((), ("embed",), out[1]))  # noqa: E731
        lora = adapters(cfg.lora, rngs, {"q": projection(q_out), "k": projection(kv_out), "v": projection(kv_out),
                                         "o": (((), (H, K), (D,)), ((), ("heads", "kv"), ("embed",)))})
        self.lora_q, self.lora_k, self.lora_v, self.lora_o = lora["q"], lora["k"], lora["v"], lora["o"]
        self.frequencies = rope_frequencies(cfg) if cfg.positions == "rope" else None
        self.kernel = cfg.attention
        self.flash_blocks = cfg.flash_blocks()

    def __call__(self, x_BLD: jax.Array, segments: Segments | None = None,
                 keys_B: jax.Array | None = None) -> jax.Array:
        """Causal self-attention; with `segments` (packed rows) each document attends to itself alone
        and its rotary positions restart at 0. keys_B (training): a PRNG key per row, for the adapters'
        dropout."""
        positions = None if segments is None else segments.positions_BL
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD, positions, keys_B)
        ids_BL = None if segments is None else segments.ids_BL
        out_BLHK = context_attention(q_BLHK, k_BLGK, v_BLGK, ids_BL, self.flash_blocks)
        return self.output(self._attend(q_BLHK, k_BLGK, v_BLGK, segments) if out_BLHK is None else out_BLHK, keys_B)

    def _attend(self, q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, segments: Segments | None):
        """Attention with whole sequences on each device, by model.attention's kernel."""
        kernel = attention_kernel(self.kernel, q_BLHK.dtype, q_BLHK.shape[1], self.flash_blocks)
        if kernel == "cudnn":  # takes the fewer key/value heads as they are; a packed row as a mask
            mask = None if segments is None else segments.visible_BLP()[:, None]
            out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask, is_causal=True,
                                                    implementation="cudnn")
        else:
            k_BLHK, v_BLHK = (repeat_kv_heads(t, q_BLHK.shape[2]) for t in (k_BLGK, v_BLGK))
            if kernel == "flash":
                out_BLHK = flash_attention(q_BLHK, k_BLHK, v_BLHK, block_q=self.flash_blocks[0],
                                           block_kv=self.flash_blocks[1],
                                           segment_ids_BL=None if segments is None else segments.ids_BL)
            else:
                out_BLHK = dot_attention(q_BLHK, k_BLHK, v_BLHK,
                                         None if segments is None else segments.visible_BLP()[:, None])
        return out_BLHK

    def decode(self, x_BLD: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The next L positions with a key/value cache: their keys and values are written into the
        cache at cache.length, and their queries attend to every cached position of their row from the
        row's first (cache.starts_B: a left-padded prompt's) up to their own."""
        slots_L = cache.length + jnp.arange(x_BLD.shape[1])
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD, cache.positions_BL(x_BLD.shape[1]))
        cache = cache.append(k_BLGK, v_BLGK)
        k_BPHK, v_BPHK = (repeat_kv_heads(t, q_BLHK.shape[2]) for t in (cache.k_BPGK, cache.v_BPGK))
        return self.output(dot_attention(q_BLHK, k_BPHK, v_BPHK, cache.visible_B1LP(slots_L))), cache

    def output(self, out_BLHK: jax.Array, keys_B: jax.Array | None = None) -> jax.Array:
        """The heads' outputs through the output projection, into the residual stream."""
        names, residual = ("batch", "seq", "heads", "kv"), ("batch", "residual_seq", "embed")
        out_BLHK = constrain(out_BLHK, names)
        return constrain(with_lora(row_parallel("BLHK,HKD->BLD", out_BLHK, self.wo, names, residual),
                                   lora_output(out_BLHK, self.lora_o, names, residual, ins=2, keys_B=keys_B)), residual)

    def project(self, x_BLD: jax.Array, positions: jax.Array | None = None, keys_B: jax.Array | None = None):
        """q (B, L, H, K) and k, v (B, L, G, K), G the key/value heads, with biases, head norms and
        rotary positions applied (positions: (L,) or per row (B, L); default 0 ... L-1)."""
        names, kv_names = ("batch", "seq", "heads", "kv"), ("batch", "seq", "kv_heads", "kv")
        residual = ("batch", "residual_seq", "embed")
        if self.fused_qkv:
            fused = ("batch", "seq", None, "heads", "kv")
            qkv_BLQHK = with_lora(column_parallel("BLD,DQHK->BLQHK", x_BLD, self.w_qkv, residual, fused),
                                  lora_output(x_BLD, self._qkv_adapters, residual, fused, keys_B=keys_B))
            if self.b_qkv is not None:
                qkv_BLQHK = qkv_BLQHK + self.b_qkv[...]
            q_BLHK, k_BLGK, v_BLGK = (constrain(qkv_BLQHK[:, :, i], names) for i in range(3))
        else:
            fused = ("batch", "seq", None, "kv_heads", "kv")
            q_BLHK = with_lora(column_parallel("BLD,DHK->BLHK", x_BLD, self.w_q, residual, names),
                               lora_output(x_BLD, self.lora_q, residual, names, keys_B=keys_B))
            kv_BLQGK = with_lora(column_parallel("BLD,DQGK->BLQGK", x_BLD, self.w_kv, residual, fused),
                                 lora_output(x_BLD, self._qkv_adapters[1:], residual, fused, keys_B=keys_B))
            if self.b_q is not None:
                q_BLHK, kv_BLQGK = q_BLHK + self.b_q[...], kv_BLQGK + self.b_kv[...]
            q_BLHK = constrain(q_BLHK, names)
            k_BLGK, v_BLGK = (constrain(kv_BLQGK[:, :, i], kv_names) for i in range(2))
        if self.q_norm is not None:
            q_BLHK, k_BLGK = self.q_norm(q_BLHK), self.k_norm(k_BLGK)
        if self.frequencies is not None:
            q_BLHK = rotary(q_BLHK, self.frequencies, positions)
            k_BLGK = rotary(k_BLGK, self.frequencies, positions)
        return q_BLHK, k_BLGK, v_BLGK

    @property
    def _qkv_adapters(self):
        return self.lora_q, self.lora_k, self.lora_v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One attention layer's keys and values for B rows of P slots (B, P, G, K), of which the first
    `length` are filled. Row b's sequence starts at slot starts_B[b] (a prompt left-padded to the
    batch's longest): the slots before it are padding that no query of the row sees, and slot s holds
    the row's position s - starts_B[b]."""

    k_BPGK: jax.Array
    v_BPGK: jax.Array
    length: jax.Array
    starts_B: jax.Array

    @staticmethod
    def empty(batch: int, positions: int, cfg: ModelConfig, dtype, starts_B: jax.Array | None = None) -> KVCache:
        shape = (batch, positions, cfg.kv_heads, cfg.head_size)
        starts_B = jnp.zeros((batch,), jnp.int32) if starts_B is None else jnp.asarray(starts_B, jnp.int32)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32), starts_B)

    def positions_BL(self, new: int) -> jax.Array:
        """The positions of the next `new` slots in each row (0 for a padding slot, which nothing reads)."""
        return jnp.maximum(self.length + jnp.arange(new)[None, :] - self.starts_B[:, None], 0)

    def visible_B1LP(self, slots_L: jax.Array) -> jax.Array:
        """Which slots each query slot sees: its row's from the row's start up to its own; a padding
        query sees itself alone (its output is never read, but must stay finite)."""
        slot_P = jnp.arange(self.k_BPGK.shape[1])
        in_row_BLP = (slot_P[None, None, :] >= self.starts_B[:, None, None]) & (slot_P <= slots_L[:, None])[None]
        return (in_row_BLP | (slot_P == slots_L[:, None])[None])[:, None]

    def append(self, k_BLGK: jax.Array, v_BLGK: jax.Array) -> KVCache:
        at, names = (0, self.length, 0, 0), ("batch", None, "kv_heads", "kv")
        k_BPGK = jax.lax.dynamic_update_slice(self.k_BPGK, k_BLGK.astype(self.k_BPGK.dtype), at)
        v_BPGK = jax.lax.dynamic_update_slice(self.v_BPGK, v_BLGK.astype(self.v_BPGK.dtype), at)
        return KVCache(constrain(k_BPGK, names), constrain(v_BPGK, names), self.length + k_BLGK.shape[1],
                       self.starts_B)


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


def dot_attention(q_BLHK: jax.Array, k_BPHK: jax.Array, v_BPHK: jax.Array,
                  visible_LP: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(K)) v with the whole L x P score matrix, scores in fp32. visible_LP: which
    keys each query sees, (L, P) or per row and broadcast over heads (B, 1, L, P) (default causal, L = P)."""
    L, K = q_BLHK.shape[1], q_BLHK.shape[-1]
    scores_BHLP = fp32_einsum("BLHK,BPHK->BHLP", q_BLHK, k_BPHK) / math.sqrt(K)
    visible_LP = jnp.tril(jnp.ones((L, L), dtype=bool)) if visible_LP is None else visible_LP
    scores_BHLP = jnp.where(visible_LP, scores_BHLP, jnp.finfo(jnp.float32).min)
    probs_BHLP = jax.nn.softmax(scores_BHLP, axis=-1).astype(q_BLHK.dtype)
    return jnp.einsum("BHLP,BPHK->BLHK", probs_BHLP, v_BPHK)
