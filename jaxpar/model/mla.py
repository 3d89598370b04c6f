"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): each head's key and value rebuilt from a
compressed latent, and a decoding cache that holds the latent alone.

Each token is projected down to a latent c of model.mla.kv_rank dimensions (then normalised) and to
one rotated key of rope_dim that every head shares. Each head's unrotated key (nope_dim) and value
(v_dim) come from an up-projection of c. Queries come straight from the model width, or through a
normalised latent of q_rank when q_rank > 0; each head's query has nope_dim unrotated and rope_dim
rotated dimensions.

Training runs the plain form: keys and values built for every head, then attention by
model.attention's kernel. Decoding runs the absorbed form: the key up-projection is folded into the
queries (q_nope W_uk: one kv_rank vector per head), the scores are taken against the cached latents
themselves, and the value up-projection is applied after the weighted sum of latents. So the cache
holds kv_rank + rope_dim numbers per token and layer, whatever the heads.

Tensor parallelism splits the heads (the up-projections and the output projection); the
down-projections and the latents are replicated on every tensor rank.

Dimension letters: B rows, L new positions, P cache slots, D model width, H heads, R kv_rank,
Q q_rank, N nope_dim, E rope_dim, V v_dim, K = N + E (a head's query and key), M = N + V, F = R + E.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.model import ModelConfig
from jaxpar.model.attention import attend
from jaxpar.model.axes import column_parallel, constrain, fp32_einsum, param, row_parallel
from jaxpar.model.layers import RMSNorm, rope_attention_factor, rope_frequencies, rotary
from jaxpar.model.scores import ScoreOptions
from jaxpar.model.segments import Segments

HEADS = ("batch", "seq", "heads", "kv")
RESIDUAL = ("batch", "residual_seq", "embed")
WHOLE = ("batch", "seq", "embed")  # the residual stream whole along the sequence (under sequence parallelism)
LATENT = ("batch", "seq", None)  # replicated over tensor: every rank rebuilds its own heads from it


class LatentAttention(nnx.Module):
    """Causal self-attention through a key/value latent; the interface of jaxpar.model.attention.Attention
    (`__call__`, `decode` with a LatentCache, `output`). `local`: a windowed layer's rotary base."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, local: bool = False):
        D, H, mla = cfg.d_model, cfg.n_heads, cfg.mla
        R, Q, N, E, V = mla.kv_rank, mla.q_rank, mla.nope_dim, mla.rope_dim, mla.v_dim
        self.nope, self.rope = N, E
        # queries through a latent of Q (normalised), or straight from the model width
        self.w_q_down = param(rngs.params(), (D, Q), ("embed", None), D ** -0.5) if Q else None
        self.q_norm = RMSNorm(Q, cfg.norm_eps, (None,), cfg.norm_offset) if Q else None
        self.w_q_up = param(rngs.params(), (Q, H, N + E), (None, "heads", "kv"), Q ** -0.5) if Q else None
        self.w_q = None if Q else param(rngs.params(), (D, H, N + E), ("embed", "heads", "kv"), D ** -0.5)
        self.w_kv_down = param(rngs.params(), (D, R + E), ("embed", None), D ** -0.5)  # the latent, the shared key
        self.kv_norm = RMSNorm(R, cfg.norm_eps, (None,), cfg.norm_offset)
        self.w_kv_up = param(rngs.params(), (R, H, N + V), (None, "heads", "kv"), R ** -0.5)  # key nope, value
        # GPT-2 style: residual projections scaled down with depth.
        self.wo = param(rngs.params(), (H, V, D), ("heads", "kv", "embed"),
                        (H * V) ** -0.5 / math.sqrt(2 * cfg.n_layers))
        self.frequencies = rope_frequencies(cfg, local, width=E)
        self.rope_factor = rope_attention_factor(cfg, local)
        self.options = ScoreOptions.of(cfg, local)  # the scale: model.attn_scale, or 1 / sqrt(K)
        self.kernel = cfg.attention
        self.flash_blocks = cfg.flash_blocks()

    def __call__(self, x_BLD: jax.Array, segments: Segments | None = None,
                 keys_B: jax.Array | None = None) -> jax.Array:
        """Causal attention over whole sequences; with `segments` (packed rows) each document attends to
        itself alone and its rotary positions restart at 0. keys_B: unused (no adapters)."""
        positions = None if segments is None else segments.positions_BL
        latent_BLR, k_rope_BLE = self.latent(x_BLD, positions)
        q_nope_BLHN, q_rope_BLHE = self.queries(x_BLD, positions)
        kv_BLHM = constrain(jnp.einsum("BLR,RHM->BLHM", latent_BLR, self.w_kv_up[...]), HEADS)
        k_nope_BLHN, v_BLHV = kv_BLHM[..., :self.nope], kv_BLHM[..., self.nope:]
        k_rope_BLHE = jnp.broadcast_to(k_rope_BLE[:, :, None], q_rope_BLHE.shape)
        q_BLHK = constrain(jnp.concatenate([q_nope_BLHN, q_rope_BLHE], axis=-1), HEADS)
        k_BLHK = constrain(jnp.concatenate([k_nope_BLHN, k_rope_BLHE], axis=-1), HEADS)
        # the shared kernels take values of their own width (v_dim beside nope_dim + rope_dim)
        return self.output(attend(q_BLHK, k_BLHK, v_BLHV, segments, self.options, self.kernel, self.flash_blocks))

    def decode(self, x_BLD: jax.Array, cache: LatentCache) -> tuple[jax.Array, LatentCache]:
        """The next L positions in the absorbed form: their latents and rotated keys are written into the
        cache at cache.length, and each head's query attends to the cached latents of its row, from the
        row's first slot (cache.starts_B) up to its own."""
        L, N = x_BLD.shape[1], self.nope
        slots_L, positions_BL = cache.length + jnp.arange(L), cache.positions_BL(L)
        latent_BLR, k_rope_BLE = self.latent(x_BLD, positions_BL)
        cache = cache.append(latent_BLR, k_rope_BLE)
        q_nope_BLHN, q_rope_BLHE = self.queries(x_BLD, positions_BL)
        w_kv_RHM = self.w_kv_up[...]
        q_latent_BLHR = constrain(jnp.einsum("BLHN,RHN->BLHR", q_nope_BLHN, w_kv_RHM[..., :N]), HEADS)
        scores_BHLP = (fp32_einsum("BLHR,BPR->BHLP", q_latent_BLHR, cache.latent_BPR)
                       + fp32_einsum("BLHE,BPE->BHLP", q_rope_BLHE, cache.k_rope_BPE))
        scores_BHLP = jnp.where(cache.visible_B1LP(slots_L), self.options.logits(scores_BHLP, N + self.rope),
                                jnp.finfo(jnp.float32).min)
        probs_BHLP = jax.nn.softmax(scores_BHLP, axis=-1).astype(x_BLD.dtype)
        out_latent_BLHR = constrain(jnp.einsum("BHLP,BPR->BLHR", probs_BHLP, cache.latent_BPR), HEADS)
        return self.output(jnp.einsum("BLHR,RHV->BLHV", out_latent_BLHR, w_kv_RHM[..., N:])), cache

    def output(self, out_BLHV: jax.Array, keys_B: jax.Array | None = None) -> jax.Array:
        """The heads' outputs through the output projection, into the residual stream."""
        out_BLHV = constrain(out_BLHV, HEADS)
        return constrain(row_parallel("BLHV,HVD->BLD", out_BLHV, self.wo, HEADS, RESIDUAL), RESIDUAL)

    def latent(self, x_BLD: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The normalised latent (B, L, R) and the rotated key every head shares (B, L, E): what the
        decoding cache holds."""
        # A plain einsum on the gathered stream, not column_parallel: under sequence parallelism that
        # sums the input's gradient over the tensor ranks, right only for a weight split by columns.
        whole_BLD = constrain(x_BLD, WHOLE)
        down_BLF = constrain(jnp.einsum("BLD,DF->BLF", whole_BLD, self.w_kv_down[...]), LATENT)
        latent_BLR = constrain(self.kv_norm(down_BLF[..., :-self.rope]), LATENT)
        k_rope_BL1E = rotary(down_BLF[:, :, None, -self.rope:], self.frequencies, positions, self.rope_factor)
        return latent_BLR, constrain(k_rope_BL1E[:, :, 0], LATENT)

    def queries(self, x_BLD: jax.Array, positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Each head's unrotated (B, L, H, N) and rotated (B, L, H, E) query."""
        if self.w_q is not None:
            q_BLHK = column_parallel("BLD,DHK->BLHK", x_BLD, self.w_q, RESIDUAL, HEADS)
        else:
            down_BLQ = constrain(jnp.einsum("BLD,DQ->BLQ", constrain(x_BLD, WHOLE), self.w_q_down[...]), LATENT)
            q_BLHK = jnp.einsum("BLQ,QHK->BLHK", self.q_norm(down_BLQ), self.w_q_up[...])
        q_BLHK = constrain(q_BLHK, HEADS)
        q_rope_BLHE = rotary(q_BLHK[..., self.nope:], self.frequencies, positions, self.rope_factor)
        return q_BLHK[..., :self.nope], q_rope_BLHE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache:
    """One latent-attention layer's decoding cache for B rows of P slots: the normalised latents
    (B, P, R) and the rotated shared keys (B, P, E), of which the first `length` are filled; rows start
    at starts_B as jaxpar.model.attention.KVCache's do (left-padded prompts)."""

    latent_BPR: jax.Array
    k_rope_BPE: jax.Array
    length: jax.Array
    starts_B: jax.Array

    @staticmethod
    def empty(batch: int, positions: int, cfg: ModelConfig, dtype, starts_B: jax.Array | None = None) -> LatentCache:
        starts_B = jnp.zeros((batch,), jnp.int32) if starts_B is None else jnp.asarray(starts_B, jnp.int32)
        return LatentCache(jnp.zeros((batch, positions, cfg.mla.kv_rank), dtype),
                           jnp.zeros((batch, positions, cfg.mla.rope_dim), dtype), jnp.zeros((), jnp.int32), starts_B)

    def positions_BL(self, new: int) -> jax.Array:
        """The positions of the next `new` slots in each row (0 for a padding slot, which nothing reads)."""
        return jnp.maximum(self.length + jnp.arange(new)[None, :] - self.starts_B[:, None], 0)

    def visible_B1LP(self, slots_L: jax.Array) -> jax.Array:
        """Which slots each query slot sees: its row's from the row's start up to its own; a padding
        query sees itself alone (its output is never read, but must stay finite)."""
        slot_P = jnp.arange(self.latent_BPR.shape[1])
        in_row_BLP = (slot_P[None, None, :] >= self.starts_B[:, None, None]) & (slot_P <= slots_L[:, None])[None]
        return (in_row_BLP | (slot_P == slots_L[:, None])[None])[:, None]

    def append(self, latent_BLR: jax.Array, k_rope_BLE: jax.Array) -> LatentCache:
        at, names = (0, self.length, 0), ("batch", None, None)
        latent_BPR = jax.lax.dynamic_update_slice(self.latent_BPR, latent_BLR.astype(self.latent_BPR.dtype), at)
        k_rope_BPE = jax.lax.dynamic_update_slice(self.k_rope_BPE, k_rope_BLE.astype(self.k_rope_BPE.dtype), at)
        return LatentCache(constrain(latent_BPR, names), constrain(k_rope_BPE, names),
                           self.length + latent_BLR.shape[1], self.starts_B)
