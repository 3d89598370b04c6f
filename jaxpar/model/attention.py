"""Causal self-attention with grouped-query heads; heads are the unit of tensor parallelism.

The scores can be computed three ways (`model.attention`): `dot` materialises the B x H x L x L
scores; `flash` (jaxpar.model.flash) runs blockwise with an online softmax and O(L) memory on any
backend; `cudnn` calls cuDNN's fused kernel through `jax.nn.dot_product_attention` (GPU,
bf16/fp16). `auto` picks cudnn where it runs, else flash when the sequence spans more than one
block, else dot. Scores accumulate in fp32 whatever the compute dtype. Every kernel takes the same
score options (jaxpar.model.scores: window, soft cap, scale) and sinks; `attend` is the one entry
for a layer's q, k and v (latent attention calls it too, with values of their own head width).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.model import ModelConfig
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
from jaxpar.model.layers import RMSNorm, rope_attention_factor, rope_frequencies, rotary
from jaxpar.model.scores import PLAIN, ScoreOptions
from jaxpar.model.segments import Segments

HALF_PRECISION = (jnp.bfloat16, jnp.float16)


class Attention(nnx.Module):
    """Q/K/V projections split by heads (column-parallel), the output projection by rows.

    With as many key/value heads as query heads, Q, K and V share one fused weight (one matmul,
    and in backward one all-reduce of dx); with fewer (grouped-query or multi-query attention) Q
    has its own weight and K, V share one, as their head counts and shardings differ. Query head
    h reads key/value head h // (n_heads / n_kv_heads). Optional: biases on Q, K and V
    (`model.qkv_bias`), and an RMSNorm of each query and key head before the rotation
    (`model.qk_norm`). `local`: the layer attends through model.window (with the local rotary base);
    model.attn_softcap and model.attn_scale shape every layer's scores; model.sinks adds a learned logit
    per query head (`sinks`, split over tensor like the heads) to every softmax, and model.out_bias a
    bias (`b_o`) on the output, added once after the row-parallel sum.
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
        self.q_norm = RMSNorm(K, cfg.norm_eps, ("kv",), cfg.norm_offset) if cfg.qk_norm else None  # Gemma: (1 + w)
        self.k_norm = RMSNorm(K, cfg.norm_eps, ("kv",), cfg.norm_offset) if cfg.qk_norm else None
        # GPT-2 style: residual projections scaled down with depth.
        self.wo = param(rngs.params(), (H, K, D), ("heads", "kv", "embed"),
                        (H * K) ** -0.5 / math.sqrt(2 * cfg.n_layers))
        q_out, kv_out = ((H, K), ("heads", "kv")), ((G, K), ("kv_heads", "kv"))
        projection = lambda out: (((), (D,), out[0]), ((), ("embed",), out[1]))  # noqa: E731
        lora = adapters(cfg.lora, rngs, {"q": projection(q_out), "k": projection(kv_out), "v": projection(kv_out),
                                         "o": (((), (H, K), (D,)), ((), ("heads", "kv"), ("embed",)))})
        self.lora_q, self.lora_k, self.lora_v, self.lora_o = lora["q"], lora["k"], lora["v"], lora["o"]
        self.b_o = zeros_param((D,), ("embed",)) if cfg.out_bias else None
        self.sinks = zeros_param((H,), ("heads",)) if cfg.sinks else None
        self.frequencies = rope_frequencies(cfg, local) if cfg.positions == "rope" else None
        self.rope_factor = rope_attention_factor(cfg, local)
        self.options = ScoreOptions.of(cfg, local)
        self.kernel = cfg.attention
        self.flash_blocks = cfg.flash_blocks()

    def __call__(self, x_BLD: jax.Array, segments: Segments | None = None,
                 keys_B: jax.Array | None = None) -> jax.Array:
        """Causal self-attention; with `segments` (packed rows) each document attends to itself alone
        and its rotary positions restart at 0. keys_B (training): a PRNG key per row, for the adapters'
        dropout."""
        positions = None if segments is None else segments.positions_BL
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD, positions, keys_B)
        out_BLHK = attend(q_BLHK, k_BLGK, v_BLGK, segments, self.options, self.kernel, self.flash_blocks,
                          self._sinks())
        return self.output(out_BLHK, keys_B)

    def decode(self, x_BLD: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The next L positions with a key/value cache: their keys and values are written into the
        cache at cache.length, and their queries attend to every cached position of their row from the
        row's first (cache.starts_B: a left-padded prompt's) up to their own, within the window."""
        slots_L = cache.length + jnp.arange(x_BLD.shape[1])
        q_BLHK, k_BLGK, v_BLGK = self.project(x_BLD, cache.positions_BL(x_BLD.shape[1]))
        cache = cache.append(k_BLGK, v_BLGK)
        k_BPHK, v_BPHK = (repeat_kv_heads(t, q_BLHK.shape[2]) for t in (cache.k_BPGK, cache.v_BPGK))
        visible = cache.visible_B1LP(slots_L, self.options.window)
        return self.output(dot_attention(q_BLHK, k_BPHK, v_BPHK, visible, self.options, self._sinks())), cache

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]

    def output(self, out_BLHK: jax.Array, keys_B: jax.Array | None = None) -> jax.Array:
        """The heads' outputs through the output projection, into the residual stream."""
        names, residual = ("batch", "seq", "heads", "kv"), ("batch", "residual_seq", "embed")
        out_BLHK = constrain(out_BLHK, names)
        y_BLD = with_lora(row_parallel("BLHK,HKD->BLD", out_BLHK, self.wo, names, residual),
                          lora_output(out_BLHK, self.lora_o, names, residual, ins=2, keys_B=keys_B))
        return constrain(y_BLD if self.b_o is None else y_BLD + self.b_o[...], residual)  # after the rows' sum

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
            q_BLHK = rotary(q_BLHK, self.frequencies, positions, self.rope_factor)
            k_BLGK = rotary(k_BLGK, self.frequencies, positions, self.rope_factor)
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

    def visible_B1LP(self, slots_L: jax.Array, window: int = 0) -> jax.Array:
        """Which slots each query slot sees: its row's from the row's start up to its own, the last
        `window` of them if set (slots of a row run on like its positions); a padding query sees itself
        alone (its output is never read, but must stay finite)."""
        slot_P = jnp.arange(self.k_BPGK.shape[1])
        sees_LP = ScoreOptions(window=window).sees(slots_L, slot_P)
        in_row_BLP = (slot_P[None, None, :] >= self.starts_B[:, None, None]) & sees_LP[None]
        return (in_row_BLP | (slot_P == slots_L[:, None])[None])[:, None]

    def append(self, k_BLGK: jax.Array, v_BLGK: jax.Array) -> KVCache:
        at, names = (0, self.length, 0, 0), ("batch", None, "kv_heads", "kv")
        k_BPGK = jax.lax.dynamic_update_slice(self.k_BPGK, k_BLGK.astype(self.k_BPGK.dtype), at)
        v_BPGK = jax.lax.dynamic_update_slice(self.v_BPGK, v_BLGK.astype(self.v_BPGK.dtype), at)
        return KVCache(constrain(k_BPGK, names), constrain(v_BPGK, names), self.length + k_BLGK.shape[1],
                       self.starts_B)


def attention_kernel(choice: str, dtype, seq_len: int, flash_blocks: tuple[int, int], fused: bool = True) -> str:
    """The kernel `model.attention` runs with: `auto` resolved for this backend, dtype and length (and
    never cudnn unless `fused`: cuDNN's kernel has no soft cap or sinks, and needs values as wide as keys)."""
    if choice != "auto":
        return choice
    if jax.default_backend() == "gpu" and dtype in HALF_PRECISION and fused:
        return "cudnn"
    return "flash" if seq_len > min(flash_blocks) else "dot"


def repeat_kv_heads(x_BLGK: jax.Array, heads: int) -> jax.Array:
    """Each key/value head repeated for the query heads that read it: (B, L, G, K) -> (B, L, H, K).
    Constrained like the query heads, so each tensor rank builds only the heads it holds."""
    groups = heads // x_BLGK.shape[2]
    x_BLHK = x_BLGK if groups == 1 else jnp.repeat(x_BLGK, groups, axis=2)
    return constrain(x_BLHK, ("batch", "seq", "heads", "kv"))


def attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGV: jax.Array, segments: Segments | None,
           options: ScoreOptions, kernel: str, blocks: tuple[int, int], sinks_H: jax.Array | None = None) -> jax.Array:
    """Causal attention of q (B, L, H, K) over k (B, L, G, K) and v (B, L, G, V), G key/value heads
    dividing the H query heads, by model.attention's `kernel` (flash in `blocks` of (queries, keys)),
    or across context devices where a layout splits the sequence; with `options` (window, soft cap,
    scale), the sinks' logits (H,) and packed rows' `segments`. Output (B, L, H, V) in q's dtype."""
    ids_BL = None if segments is None else segments.ids_BL
    out_BLHV = context_attention(q_BLHK, k_BLGK, v_BLGV, ids_BL, blocks, options, sinks_H)
    if out_BLHV is not None:
        return out_BLHV
    fused = not options.softcap and sinks_H is None and v_BLGV.shape[-1] == q_BLHK.shape[-1]
    kernel = attention_kernel(kernel, q_BLHK.dtype, q_BLHK.shape[1], blocks, fused)
    if kernel == "cudnn":  # takes the fewer key/value heads as they are
        return cudnn_attention(q_BLHK, k_BLGK, v_BLGV, segments, options)
    k_BLHK, v_BLHV = (repeat_kv_heads(t, q_BLHK.shape[2]) for t in (k_BLGK, v_BLGV))
    if kernel == "flash":
        return flash_attention(q_BLHK, k_BLHK, v_BLHV, block_q=blocks[0], block_kv=blocks[1], segment_ids_BL=ids_BL,
                               options=options, sinks_H=sinks_H)
    visible_B1LP = None if segments is None else segments.visible_BLP(options.window)[:, None]
    return dot_attention(q_BLHK, k_BLHK, v_BLHV, visible_B1LP, options, sinks_H)


def cudnn_attention(q_BLHK, k_BLGK, v_BLGK, segments: Segments | None, options: ScoreOptions,
                    implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused kernel: a packed row as a mask, the window as its local_window_size (the window - 1
    keys before each query, none after); no soft cap or sinks (refused by the config checks)."""
    mask = None if segments is None else segments.visible_BLP()[:, None]
    window = (options.window - 1, 0) if options.window else None
    return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask, scale=options.scale or None,
                                        is_causal=True, local_window_size=window, implementation=implementation)


def dot_attention(q_BLHK: jax.Array, k_BPHK: jax.Array, v_BPHV: jax.Array, visible_LP: jax.Array | None = None,
                  options: ScoreOptions = PLAIN, sinks_H: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T · scale) v with the whole L x P score matrix, scores in fp32, soft-capped by
    `options`; sinks_H: each head's sink logit, one more softmax column that adds nothing. visible_LP:
    which keys each query sees, (L, P) or per row and broadcast over heads (B, 1, L, P) (default causal
    and in options.window, L = P)."""
    L, P, K = q_BLHK.shape[1], k_BPHK.shape[1], q_BLHK.shape[-1]
    logits_BHLP = options.logits(fp32_einsum("BLHK,BPHK->BHLP", q_BLHK, k_BPHK), K)
    visible_LP = options.sees(jnp.arange(L), jnp.arange(P)) if visible_LP is None else visible_LP
    logits_BHLP = jnp.where(visible_LP, logits_BHLP, jnp.finfo(jnp.float32).min)
    if sinks_H is not None:  # one more column, dropped after the softmax
        B, H = logits_BHLP.shape[:2]
        sink_BHL1 = jnp.broadcast_to(sinks_H.astype(jnp.float32)[None, :, None, None], (B, H, L, 1))
        probs_BHLP = jax.nn.softmax(jnp.concatenate([logits_BHLP, sink_BHL1], -1), axis=-1)[..., :P]
    else:
        probs_BHLP = jax.nn.softmax(logits_BHLP, axis=-1)
    return jnp.einsum("BHLP,BPHV->BLHV", probs_BHLP.astype(q_BLHK.dtype), v_BPHV)
