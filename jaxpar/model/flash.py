"""Memory-efficient causal blockwise ("flash") attention in pure JAX.

Forward (FlashAttention-2): the L query positions are cut into blocks of `block_q`, the P key
positions into blocks of `block_kv`. For each query block a loop over key blocks keeps an
online softmax: running row max m, running row sum l (fp32) and an fp32 accumulator of
probs @ V, rescaled by exp(m_old - m_new) whenever the max grows. Causality is exploited, not
only enforced: key blocks lying wholly above the diagonal (every key later than every query of
the block) are never visited, key blocks wholly below it are used without a mask, and only the
blocks crossing the diagonal are masked. That halves the work of a dense causal attention and
means no value in a skipped block can ever reach the output (not even a NaN via 0 * NaN).

Backward (`jax.custom_vjp`): forward saves only q, k, v, the output and the per-row logsumexp
(lse = m + log l), so beyond the inputs it keeps O(B·L·H) numbers, never an L×P array. The
backward recomputes the probabilities block by block, p = exp(scores - lse), with
D = rowsum(dO * O): for each key block it loops over the query blocks at or below the diagonal,
accumulating that key block's dK, dV in block-sized fp32 buffers and adding the dQ contributions
into one fp32 (B, L, H, K) buffer, so a single pass recomputes each visible block once.

Peak temporary memory is therefore O(B·H·block_q·block_kv) for a block's scores plus O(B·L·H·K)
for the fp32 output / dQ buffers, against O(B·H·L·L) for dense attention. All slicing is along
L (dynamic_slice), so inputs sharded over B and H by the SPMD partitioner stay sharded.

Shapes: B batch, L query positions, P key positions, H heads, K head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

f32 = jnp.float32


def flash_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHK: jax.Array, *, block_q: int,
                    block_kv: int, segment_ids_BL: jax.Array | None = None) -> jax.Array:
    """Causal softmax(q kᵀ / sqrt(K)) v, blockwise; output (B, L, H, K) in q's dtype.

    segment_ids_BL (packed rows, non-decreasing along each row): a query sees the keys of its own
    document only. Key blocks that end before the first query's document begins (in every row) are
    not visited, nor, in backward, query blocks that begin after the key block's last document ends.
    """
    L = q_BLHK.shape[1]
    assert k_BLHK.shape == v_BLHK.shape == q_BLHK.shape, (q_BLHK.shape, k_BLHK.shape, v_BLHK.shape)
    assert L % block_q == 0 and L % block_kv == 0, f"L={L} not divisible by blocks {block_q}, {block_kv}"
    ids_BL = None if segment_ids_BL is None else segment_ids_BL.astype(jnp.int32)
    return _flash(q_BLHK, k_BLHK, v_BLHK, ids_BL, block_q, block_kv)


def _rows(x: jax.Array, start, size: int, axis: int = 1) -> jax.Array:
    """Positions [start, start + size) of x along its L axis."""
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(q_BLHK, k_BPHK, q0, k0, masked: bool, ids_BL=None) -> jax.Array:
    """Scaled fp32 scores of one (query block, key block) pair; -inf above the diagonal if masked,
    and with the row's segment ids, -inf between different documents."""
    scores_BHLP = jnp.einsum("BLHK,BPHK->BHLP", q_BLHK, k_BPHK, preferred_element_type=f32)
    scores_BHLP = scores_BHLP / math.sqrt(q_BLHK.shape[-1])
    if masked:  # only diagonal-crossing blocks pay for the mask
        q_L = q0 + jnp.arange(q_BLHK.shape[1])
        k_P = k0 + jnp.arange(k_BPHK.shape[1])
        scores_BHLP = jnp.where(q_L[:, None] >= k_P[None, :], scores_BHLP, -jnp.inf)
    if ids_BL is not None:
        same_BLP = _rows(ids_BL, q0, q_BLHK.shape[1])[:, :, None] == _rows(ids_BL, k0, k_BPHK.shape[1])[:, None, :]
        scores_BHLP = jnp.where(same_BLP[:, None], scores_BHLP, -jnp.inf)
    return scores_BHLP


# Packed rows: segment ids are non-decreasing along a row, so the keys a query block can see begin
# at the first position of its first query's document, and the queries that can see a key block end
# with the key block's last document. A row's first visited key blocks may hide all of its keys
# (another row's document began earlier), so there the running max is still -inf and is shifted by
# 0 instead.


def _first_key_block(ids_BL, q0, bkv: int):
    """The first key block holding a key of query q0's document, in any row."""
    first_B = _rows(ids_BL, q0, 1)[:, 0]
    return jnp.min(jnp.argmax(ids_BL == first_B[:, None], axis=1)) // bkv


def _query_blocks_end(ids_BL, k_last, bq: int):
    """One past the last query block holding a query of key k_last's document, in any row."""
    last_B = _rows(ids_BL, k_last, 1)[:, 0]
    return (jnp.max(jnp.sum(ids_BL <= last_B[:, None], axis=1)) + bq - 1) // bq


def _forward(q_BLHK, k_BLHK, v_BLHK, ids_BL, bq: int, bkv: int):
    B, L, H, K = q_BLHK.shape

    def query_block(i, carry):
        out_BLHK, lse_BHL = carry
        q0 = i * bq
        qi_BLHK = _rows(q_BLHK, q0, bq)

        def key_block(masked, j, state):
            m_BHL, l_BHL, acc_BHLK = state
            k0 = j * bkv
            scores_BHLP = _scores(qi_BLHK, _rows(k_BLHK, k0, bkv), q0, k0, masked, ids_BL)
            m_new_BHL = jnp.maximum(m_BHL, scores_BHLP.max(-1))  # finite without segments: key 0 is in block 0
            shift_BHL = m_new_BHL if ids_BL is None else jnp.where(jnp.isfinite(m_new_BHL), m_new_BHL, 0.0)
            probs_BHLP = jnp.exp(scores_BHLP - shift_BHL[..., None])
            rescale_BHL = jnp.exp(m_BHL - shift_BHL)  # old sums were relative to the old max
            pv_BHLK = jnp.einsum("BHLP,BPHK->BHLK", probs_BHLP.astype(v_BLHK.dtype), _rows(v_BLHK, k0, bkv),
                                 preferred_element_type=f32)
            return m_new_BHL, l_BHL * rescale_BHL + probs_BHLP.sum(-1), acc_BHLK * rescale_BHL[..., None] + pv_BHLK

        # Key blocks [0, n_full) end at or before the block's first query: no mask. Blocks
        # [n_full, n_visible) cross the diagonal. Blocks from n_visible on are skipped.
        # With segments every visited block is masked, from the first one of q0's document.
        n_full = (q0 + 1) // bkv
        n_visible = (q0 + bq + bkv - 1) // bkv
        state = (jnp.full((B, H, bq), -jnp.inf, f32), jnp.zeros((B, H, bq), f32), jnp.zeros((B, H, bq, K), f32))
        if ids_BL is None:
            state = lax.fori_loop(0, n_full, functools.partial(key_block, False), state)
        first = n_full if ids_BL is None else _first_key_block(ids_BL, q0, bkv)
        m_BHL, l_BHL, acc_BHLK = lax.fori_loop(first, n_visible, functools.partial(key_block, True), state)
        oi_BLHK = jnp.transpose(acc_BHLK / l_BHL[..., None], (0, 2, 1, 3)).astype(q_BLHK.dtype)
        out_BLHK = lax.dynamic_update_slice_in_dim(out_BLHK, oi_BLHK, q0, 1)
        lse_BHL = lax.dynamic_update_slice_in_dim(lse_BHL, m_BHL + jnp.log(l_BHL), q0, 2)
        return out_BLHK, lse_BHL

    init = (jnp.zeros_like(q_BLHK), jnp.zeros((B, H, L), f32))
    return lax.fori_loop(0, L // bq, query_block, init)


def _backward(bq: int, bkv: int, residuals, dout_BLHK):
    q_BLHK, k_BLHK, v_BLHK, ids_BL, out_BLHK, lse_BHL = residuals
    L = q_BLHK.shape[1]
    scale = 1.0 / math.sqrt(q_BLHK.shape[-1])
    dout_BLHK = dout_BLHK.astype(q_BLHK.dtype)
    # D = rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's subtracted term, per row.
    delta_BHL = jnp.einsum("BLHK,BLHK->BHL", dout_BLHK, out_BLHK, preferred_element_type=f32)

    def key_block(j, carry):
        dq_BLHK, dk_BLHK, dv_BLHK = carry
        k0 = j * bkv
        kj_BPHK, vj_BPHK = _rows(k_BLHK, k0, bkv), _rows(v_BLHK, k0, bkv)

        def query_block(masked, i, state):
            dq_BLHK, dk_BPHK, dv_BPHK = state
            q0 = i * bq
            qi_BLHK, doi_BLHK = _rows(q_BLHK, q0, bq), _rows(dout_BLHK, q0, bq)
            scores_BHLP = _scores(qi_BLHK, kj_BPHK, q0, k0, masked, ids_BL)
            probs_BHLP = jnp.exp(scores_BHLP - _rows(lse_BHL, q0, bq, 2)[..., None])  # recomputed, not saved
            dv_BPHK = dv_BPHK + jnp.einsum("BHLP,BLHK->BPHK", probs_BHLP.astype(doi_BLHK.dtype), doi_BLHK,
                                           preferred_element_type=f32)
            dprobs_BHLP = jnp.einsum("BLHK,BPHK->BHLP", doi_BLHK, vj_BPHK, preferred_element_type=f32)
            dscores_BHLP = probs_BHLP * (dprobs_BHLP - _rows(delta_BHL, q0, bq, 2)[..., None]) * scale
            dk_BPHK = dk_BPHK + jnp.einsum("BHLP,BLHK->BPHK", dscores_BHLP.astype(qi_BLHK.dtype), qi_BLHK,
                                           preferred_element_type=f32)
            dqi_BLHK = jnp.einsum("BHLP,BPHK->BLHK", dscores_BHLP.astype(kj_BPHK.dtype), kj_BPHK,
                                  preferred_element_type=f32)
            dq_BLHK = lax.dynamic_update_slice_in_dim(dq_BLHK, _rows(dq_BLHK, q0, bq) + dqi_BLHK, q0, 1)
            return dq_BLHK, dk_BPHK, dv_BPHK

        # Query blocks before i_start end before this key block's first key: skipped. Blocks
        # [i_start, i_full) cross the diagonal: masked. From i_full on every query sees every key.
        # With segments every visited block is masked, up to the last one of the key block's last document.
        i_start = k0 // bq
        i_full = jnp.minimum((k0 + bkv - 1 + bq - 1) // bq, L // bq)
        zeros_BPHK = jnp.zeros(kj_BPHK.shape, f32)
        state = (dq_BLHK, zeros_BPHK, zeros_BPHK)
        if ids_BL is None:
            state = lax.fori_loop(i_start, i_full, functools.partial(query_block, True), state)
            dq_BLHK, dk_BPHK, dv_BPHK = lax.fori_loop(i_full, L // bq, functools.partial(query_block, False), state)
        else:
            end = _query_blocks_end(ids_BL, k0 + bkv - 1, bq)
            dq_BLHK, dk_BPHK, dv_BPHK = lax.fori_loop(i_start, end, functools.partial(query_block, True), state)
        dk_BLHK = lax.dynamic_update_slice_in_dim(dk_BLHK, dk_BPHK.astype(k_BLHK.dtype), k0, 1)
        dv_BLHK = lax.dynamic_update_slice_in_dim(dv_BLHK, dv_BPHK.astype(v_BLHK.dtype), k0, 1)
        return dq_BLHK, dk_BLHK, dv_BLHK

    init = (jnp.zeros(q_BLHK.shape, f32), jnp.zeros_like(k_BLHK), jnp.zeros_like(v_BLHK))
    dq_BLHK, dk_BLHK, dv_BLHK = lax.fori_loop(0, L // bkv, key_block, init)
    return dq_BLHK.astype(q_BLHK.dtype), dk_BLHK, dv_BLHK, None  # segment ids: integers, no cotangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q_BLHK, k_BLHK, v_BLHK, ids_BL, bq: int, bkv: int) -> jax.Array:
    return _forward(q_BLHK, k_BLHK, v_BLHK, ids_BL, bq, bkv)[0]


def _flash_fwd(q_BLHK, k_BLHK, v_BLHK, ids_BL, bq: int, bkv: int):
    out_BLHK, lse_BHL = _forward(q_BLHK, k_BLHK, v_BLHK, ids_BL, bq, bkv)
    return out_BLHK, (q_BLHK, k_BLHK, v_BLHK, ids_BL, out_BLHK, lse_BHL)  # O(L) beyond the inputs


_flash.defvjp(_flash_fwd, _backward)
