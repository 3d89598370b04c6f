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

A sliding window (options.window) runs a schedule of its own: every query block visits the same
number of key blocks, those ending with the block holding its last query (and in backward every
key block the same number of query blocks), so each loop has a trip count known when compiling,
the work is O(L x window) and the compiled program's FLOPs show it. The first query blocks, whose
window starts before position 0, re-read key block 0 in place of the missing ones and mask it
whole (and the last key blocks, in backward, the last query block); no block above the diagonal
is read. Where that schedule would visit more blocks than the causal one (a window near L), the
causal one runs with every block masked, from the first key block inside the window.

Soft caps, the scale and the sinks are jaxpar.model.scores's; the sinks join each row's
log-sum-exp once, after its last key block. The values may have a head width of their own.

Peak temporary memory is therefore O(B·H·block_q·block_kv) for a block's scores plus O(B·L·H·K)
for the fp32 output / dQ buffers, against O(B·H·L·L) for dense attention. All slicing is along
L (dynamic_slice), so inputs sharded over B and H by the SPMD partitioner stay sharded.

Shapes: B batch, L query positions, P key positions, H heads, K head dim (queries and keys),
V the values' head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.model.scores import PLAIN, ScoreOptions, fold_sinks, masked, sink_share

f32 = jnp.float32


def flash_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHV: jax.Array, *, block_q: int, block_kv: int,
                    segment_ids_BL: jax.Array | None = None, options: ScoreOptions = PLAIN,
                    sinks_H: jax.Array | None = None) -> jax.Array:
    """Causal softmax(q kᵀ · scale) v, blockwise, with `options`' window and soft cap and the sinks'
    logits (H,) in every row's softmax; output (B, L, H, V) in q's dtype.

    segment_ids_BL (packed rows, non-decreasing along each row): a query sees the keys of its own
    document only. Key blocks that end before the first query's document begins (in every row) are
    not visited, nor, in backward, query blocks that begin after the key block's last document ends.
    """
    B, L, H, K = q_BLHK.shape
    assert k_BLHK.shape == q_BLHK.shape and v_BLHV.shape[:3] == (B, L, H), (q_BLHK.shape, k_BLHK.shape, v_BLHV.shape)
    assert L % block_q == 0 and L % block_kv == 0, f"L={L} not divisible by blocks {block_q}, {block_kv}"
    ids_BL = None if segment_ids_BL is None else segment_ids_BL.astype(jnp.int32)
    return _flash(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, _Plan(block_q, block_kv, L, options))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static schedule: block sizes, sequence length and score options."""

    bq: int
    bkv: int
    length: int
    options: ScoreOptions

    @property
    def window(self) -> int:
        """The window when it hides any key (0: causal attention alone)."""
        return self.options.window if self.options.window < self.length else 0

    def key_span(self) -> int:
        """Key blocks each query block visits under the window schedule: the most any needs."""
        W, n = self.window, self.length // self.bq
        return max((i * self.bq + self.bq - 1) // self.bkv - max(i * self.bq - W + 1, 0) // self.bkv + 1
                   for i in range(n))

    def query_span(self) -> int:
        """Query blocks each key block visits in backward under the window schedule."""
        W, n = self.window, self.length // self.bkv
        return max(min(j * self.bkv + self.bkv + W - 2, self.length - 1) // self.bq - j * self.bkv // self.bq + 1
                   for j in range(n))

    @property
    def static_window(self) -> bool:
        """Whether the window schedule runs: a window, and fewer block pairs than the causal schedule's."""
        causal = sum((i * self.bq + self.bq - 1) // self.bkv + 1 for i in range(self.length // self.bq))
        return bool(self.window) and self.key_span() * (self.length // self.bq) <= causal


def _rows(x: jax.Array, start, size: int, axis: int = 1) -> jax.Array:
    """Positions [start, start + size) of x along its L axis."""
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _logits(plan: _Plan, q_BLHK, k_BPHK, q0, k0, masked_: bool, ids_BL=None, valid=None):
    """(logits, visible) of one (query block, key block) pair: scaled and capped fp32 logits, unmasked,
    and which keys each query sees (None: all): causal and in the window if `masked_`, in the same
    document with segment ids, and none unless `valid` (a block the window schedule reads twice)."""
    qk_BHLP = jnp.einsum("BLHK,BPHK->BHLP", q_BLHK, k_BPHK, preferred_element_type=f32)
    logits_BHLP = plan.options.logits(qk_BHLP, q_BLHK.shape[-1])
    visible_BLP = None
    if masked_:  # only the blocks that need it pay for the mask
        visible_BLP = plan.options.sees(q0 + jnp.arange(q_BLHK.shape[1]), k0 + jnp.arange(k_BPHK.shape[1]))[None]
        visible_BLP = visible_BLP if valid is None else visible_BLP & valid
    if ids_BL is not None:
        same_BLP = _rows(ids_BL, q0, q_BLHK.shape[1])[:, :, None] == _rows(ids_BL, k0, k_BPHK.shape[1])[:, None, :]
        visible_BLP = same_BLP if visible_BLP is None else visible_BLP & same_BLP
    return logits_BHLP, None if visible_BLP is None else visible_BLP[:, None]


# Packed rows: segment ids are non-decreasing along a row, so the keys a query block can see begin
# at the first position of its first query's document, and the queries that can see a key block end
# with the key block's last document. A row's first visited key blocks may hide all of its keys
# (another row's document began earlier, or the window), so there the running max is still -inf and
# is shifted by 0 instead.


def _first_key_block(ids_BL, q0, bkv: int):
    """The first key block holding a key of query q0's document, in any row."""
    first_B = _rows(ids_BL, q0, 1)[:, 0]
    return jnp.min(jnp.argmax(ids_BL == first_B[:, None], axis=1)) // bkv


def _query_blocks_end(ids_BL, k_last, bq: int):
    """One past the last query block holding a query of key k_last's document, in any row."""
    last_B = _rows(ids_BL, k_last, 1)[:, 0]
    return (jnp.max(jnp.sum(ids_BL <= last_B[:, None], axis=1)) + bq - 1) // bq


def _forward(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, plan: _Plan):
    B, L, H, _ = q_BLHK.shape
    bq, bkv, W = plan.bq, plan.bkv, plan.window

    def query_block(i, carry):
        out_BLHV, lse_BHL = carry
        q0 = i * bq
        qi_BLHK = _rows(q_BLHK, q0, bq)

        def key_block(masked_, j, state, valid=None):
            m_BHL, l_BHL, acc_BHLV = state
            k0 = j * bkv
            logits_BHLP, visible = _logits(plan, qi_BLHK, _rows(k_BLHK, k0, bkv), q0, k0, masked_, ids_BL, valid)
            logits_BHLP = masked(logits_BHLP, visible)
            m_new_BHL = jnp.maximum(m_BHL, logits_BHLP.max(-1))
            shift_BHL = jnp.where(jnp.isfinite(m_new_BHL), m_new_BHL, 0.0)  # a row that sees no key yet
            probs_BHLP = jnp.exp(logits_BHLP - shift_BHL[..., None])
            rescale_BHL = jnp.exp(m_BHL - shift_BHL)  # old sums were relative to the old max
            pv_BHLV = jnp.einsum("BHLP,BPHV->BHLV", probs_BHLP.astype(v_BLHV.dtype), _rows(v_BLHV, k0, bkv),
                                 preferred_element_type=f32)
            return m_new_BHL, l_BHL * rescale_BHL + probs_BHLP.sum(-1), acc_BHLV * rescale_BHL[..., None] + pv_BHLV

        state = (jnp.full((B, H, bq), -jnp.inf, f32), jnp.zeros((B, H, bq), f32),
                 jnp.zeros((B, H, bq, v_BLHV.shape[-1]), f32))
        # Key blocks [0, n_full) end at or before the block's first query: no mask. Blocks
        # [n_full, n_visible) cross the diagonal. Blocks from n_visible on are skipped.
        n_visible = (q0 + bq + bkv - 1) // bkv
        if plan.static_window:  # key_span blocks ending with n_visible - 1; one before block 0 re-reads it, masked
            def windowed(t, state):
                j = n_visible - plan.key_span() + t
                return key_block(True, jnp.maximum(j, 0), state, j >= 0)

            m_BHL, l_BHL, acc_BHLV = lax.fori_loop(0, plan.key_span(), windowed, state)
        else:  # with segments or a window every visited block is masked, from the first one either allows
            n_full = (q0 + 1) // bkv
            first = n_full
            if ids_BL is not None or W:
                first = 0 if ids_BL is None else _first_key_block(ids_BL, q0, bkv)
                first = jnp.maximum(first, jnp.maximum(q0 - W + 1, 0) // bkv) if W else first
            else:
                state = lax.fori_loop(0, n_full, functools.partial(key_block, False), state)
            m_BHL, l_BHL, acc_BHLV = lax.fori_loop(first, n_visible, functools.partial(key_block, True), state)
        lse_i_BHL = m_BHL + jnp.log(l_BHL)
        oi_BHLV = acc_BHLV / l_BHL[..., None]
        if sinks_H is not None:
            weight_BHL, lse_i_BHL = fold_sinks(lse_i_BHL, sinks_H[None, :, None])
            oi_BHLV = oi_BHLV * weight_BHL[..., None]
        oi_BLHV = jnp.transpose(oi_BHLV, (0, 2, 1, 3)).astype(q_BLHK.dtype)
        out_BLHV = lax.dynamic_update_slice_in_dim(out_BLHV, oi_BLHV, q0, 1)
        return out_BLHV, lax.dynamic_update_slice_in_dim(lse_BHL, lse_i_BHL, q0, 2)

    init = (jnp.zeros((B, L, H, v_BLHV.shape[-1]), q_BLHK.dtype), jnp.zeros((B, H, L), f32))
    return lax.fori_loop(0, L // bq, query_block, init)


def _backward(plan: _Plan, residuals, dout_BLHV):
    q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, out_BLHV, lse_BHL = residuals
    L, K = q_BLHK.shape[1], q_BLHK.shape[-1]
    bq, bkv = plan.bq, plan.bkv
    dout_BLHV = dout_BLHV.astype(q_BLHK.dtype)
    # D = rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's subtracted term, per row.
    delta_BHL = jnp.einsum("BLHV,BLHV->BHL", dout_BLHV, out_BLHV, preferred_element_type=f32)

    def key_block(j, carry):
        dq_BLHK, dk_BLHK, dv_BLHV = carry
        k0 = j * bkv
        kj_BPHK, vj_BPHV = _rows(k_BLHK, k0, bkv), _rows(v_BLHV, k0, bkv)

        def query_block(masked_, i, state, valid=None):
            dq_BLHK, dk_BPHK, dv_BPHV = state
            q0 = i * bq
            qi_BLHK, doi_BLHV = _rows(q_BLHK, q0, bq), _rows(dout_BLHV, q0, bq)
            logits_BHLP, visible = _logits(plan, qi_BLHK, kj_BPHK, q0, k0, masked_, ids_BL, valid)
            # recomputed, not saved
            probs_BHLP = jnp.exp(masked(logits_BHLP, visible) - _rows(lse_BHL, q0, bq, 2)[..., None])
            dv_BPHV = dv_BPHV + jnp.einsum("BHLP,BLHV->BPHV", probs_BHLP.astype(doi_BLHV.dtype), doi_BLHV,
                                           preferred_element_type=f32)
            dprobs_BHLP = jnp.einsum("BLHV,BPHV->BHLP", doi_BLHV, vj_BPHV, preferred_element_type=f32)
            dlogits_BHLP = probs_BHLP * (dprobs_BHLP - _rows(delta_BHL, q0, bq, 2)[..., None])
            dqk_BHLP = plan.options.logits_grad(dlogits_BHLP, logits_BHLP, K)
            dk_BPHK = dk_BPHK + jnp.einsum("BHLP,BLHK->BPHK", dqk_BHLP.astype(qi_BLHK.dtype), qi_BLHK,
                                           preferred_element_type=f32)
            dqi_BLHK = jnp.einsum("BHLP,BPHK->BLHK", dqk_BHLP.astype(kj_BPHK.dtype), kj_BPHK,
                                  preferred_element_type=f32)
            dq_BLHK = lax.dynamic_update_slice_in_dim(dq_BLHK, _rows(dq_BLHK, q0, bq) + dqi_BLHK, q0, 1)
            return dq_BLHK, dk_BPHK, dv_BPHV

        state = (dq_BLHK, jnp.zeros(kj_BPHK.shape, f32), jnp.zeros(vj_BPHV.shape, f32))
        dq_BLHK, dk_BPHK, dv_BPHV = _query_blocks(plan, ids_BL, k0, query_block, state)
        dk_BLHK = lax.dynamic_update_slice_in_dim(dk_BLHK, dk_BPHK.astype(k_BLHK.dtype), k0, 1)
        dv_BLHV = lax.dynamic_update_slice_in_dim(dv_BLHV, dv_BPHV.astype(v_BLHV.dtype), k0, 1)
        return dq_BLHK, dk_BLHK, dv_BLHV

    init = (jnp.zeros(q_BLHK.shape, f32), jnp.zeros_like(k_BLHK), jnp.zeros_like(v_BLHV))
    dq_BLHK, dk_BLHK, dv_BLHV = lax.fori_loop(0, L // bkv, key_block, init)
    dsinks_H = None
    if sinks_H is not None:
        dsinks_H = sink_share(lse_BHL, sinks_H[None, :, None], delta_BHL).sum((0, 2)).astype(sinks_H.dtype)
    return dq_BLHK.astype(q_BLHK.dtype), dk_BLHK, dv_BLHV, None, dsinks_H  # segment ids: integers, no cotangent


def _query_blocks(plan: _Plan, ids_BL, k0, query_block, state):
    """Backward's loops over the query blocks that see key block k0 (query_block(masked, i, state))."""
    bq, bkv, W, n = plan.bq, plan.bkv, plan.window, plan.length // plan.bq
    # Query blocks before i_start end before this key block's first key: skipped. Blocks
    # [i_start, i_full) cross the diagonal: masked. From i_full on every query sees every key.
    i_start = k0 // bq
    if plan.static_window:  # query_span blocks from i_start; one past the last re-reads it, masked
        def windowed(t, state):
            i = i_start + t
            return query_block(True, jnp.minimum(i, n - 1), state, i < n)

        return lax.fori_loop(0, plan.query_span(), windowed, state)
    if ids_BL is None and not W:
        i_full = jnp.minimum((k0 + bkv - 1 + bq - 1) // bq, n)
        state = lax.fori_loop(i_start, i_full, functools.partial(query_block, True), state)
        return lax.fori_loop(i_full, n, functools.partial(query_block, False), state)
    # With segments or a window every visited block is masked, up to the last one either allows.
    end = n if ids_BL is None else _query_blocks_end(ids_BL, k0 + bkv - 1, bq)
    end = jnp.minimum(end, (k0 + bkv + W - 2) // bq + 1) if W else end
    return lax.fori_loop(i_start, end, functools.partial(query_block, True), state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, plan: _Plan) -> jax.Array:
    return _forward(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, plan)[0]


def _flash_fwd(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, plan: _Plan):
    out_BLHV, lse_BHL = _forward(q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, plan)
    return out_BLHV, (q_BLHK, k_BLHK, v_BLHV, ids_BL, sinks_H, out_BLHV, lse_BHL)  # O(L) beyond the inputs


_flash.defvjp(_flash_fwd, _backward)
