"""One pair of query and key chunks of context attention (jaxpar.parallel.context): blockwise online
softmax forward, and backward from the saved log-sum-exp, with the score options of
jaxpar.model.scores; a block pair none of whose keys a query sees is skipped, not masked.

Shapes: B batch, G key/value heads, R query heads per key/value head, K head size (V the values').
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxpar.model.scores import ScoreOptions, masked

f32 = jnp.float32


def _visible(q_pos, k_pos, q_ids, k_ids, causal: bool, options: ScoreOptions):
    """(B or 1, 1, 1, bq, bkv) bools: which keys each query sees (None: all)."""
    visible = options.sees(q_pos, k_pos)[None, None, None] if causal or options.window else None
    if q_ids is not None:
        same = (q_ids[:, :, None] == k_ids[:, None, :])[:, None, None]
        visible = same if visible is None else visible & same
    return visible


def loop(lower: int, upper: int, body, init):
    """lax.fori_loop as a while loop, never a scan: differentiating the model's layer scan partially
    evaluates what it calls, and hoisted out of scans here every block's masks and softmax statistics,
    all kept at once (seq 32768 on context=8: 0.9 GB of temporaries, 0.1 GB with while loops)."""
    def step(carry):
        i, state = carry
        return i + 1, body(i, state)

    return lax.while_loop(lambda carry: carry[0] < upper, step, (jnp.int32(lower), init))[1]


def _einsum(equation: str, a, b):
    return jnp.einsum(equation, a, b, preferred_element_type=f32)


def _rows(x, start, size: int, axis: int = 1):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis)


class Pair:
    """Queries q (B, lq, G, R, K) against keys k (B, lk, G, K) and values v (B, lk, G, V), `bq` queries by
    `bkv` keys at a time (blocks lie inside one chunk, so their positions run on by one). Causal: a block
    pair whose every key comes after every query is skipped; so is one whose every key is out of every
    query's window."""

    def __init__(self, q, k, v, q_pos, k_pos, q_ids, k_ids, causal: bool, bq: int, bkv: int, options: ScoreOptions):
        self.q, self.k, self.v, self.q_pos, self.k_pos, self.q_ids, self.k_ids = q, k, v, q_pos, k_pos, q_ids, k_ids
        self.causal, self.bq, self.bkv, self.options = causal, bq, bkv, options
        self.skips = causal or bool(options.window)

    def block(self, q0, k0):
        """(q block, k block, v block, visible, whether any key of the pair is visible)."""
        q, k = _rows(self.q, q0, self.bq), _rows(self.k, k0, self.bkv)
        q_pos, k_pos = _rows(self.q_pos, q0, self.bq, 0), _rows(self.k_pos, k0, self.bkv, 0)
        visible = _visible(q_pos, k_pos, _rows(self.q_ids, q0, self.bq), _rows(self.k_ids, k0, self.bkv), self.causal,
                           self.options)
        seen = q_pos[-1] >= k_pos[0] if self.causal else True
        if self.options.window:  # the first query's window still reaches the last key
            seen = seen & (q_pos[0] - k_pos[-1] < self.options.window)
        return q, k, _rows(self.v, k0, self.bkv), visible, seen

    def logits(self, q, k):
        """Scaled and capped fp32 logits of a block pair, unmasked."""
        return self.options.logits(_einsum("BLGRK,BPGK->BGRLP", q, k), q.shape[-1])

    def forward(self):
        """(out (B, lq, G, R, V) fp32, lse (B, G, R, lq)) over these keys alone."""
        B, lq, G, R, _ = self.q.shape

        def q_block(i, carry):
            out, lse = carry
            q0 = i * self.bq

            def kv_block(j, state):
                q, k, v, visible, seen = self.block(q0, j * self.bkv)

                def update(state):
                    m, total, acc = state
                    scores = masked(self.logits(q, k), visible)
                    m_new = jnp.maximum(m, scores.max(-1))
                    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that sees no key yet
                    probs = jnp.exp(scores - shift[..., None])
                    rescale = jnp.exp(m - shift)
                    pv = _einsum("BGRLP,BPGV->BGRLV", probs.astype(v.dtype), v)
                    return m_new, total * rescale + probs.sum(-1), acc * rescale[..., None] + pv

                return lax.cond(seen, update, lambda state: state, state) if self.skips else update(state)

            init = (jnp.full((B, G, R, self.bq), -jnp.inf, f32), jnp.zeros((B, G, R, self.bq), f32),
                    jnp.zeros((B, G, R, self.bq, self.v.shape[-1]), f32))
            m, total, acc = loop(0, self.k.shape[1] // self.bkv, kv_block, init)
            some = total > 0
            o = jnp.where(some[..., None], acc / jnp.where(some, total, 1.0)[..., None], 0.0)
            lse_i = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf)
            out = lax.dynamic_update_slice_in_dim(out, jnp.einsum("BGRLV->BLGRV", o), q0, 1)
            return out, lax.dynamic_update_slice_in_dim(lse, lse_i, q0, 3)

        init = (jnp.zeros((*self.q.shape[:-1], self.v.shape[-1]), f32), jnp.full((B, G, R, lq), -jnp.inf, f32))
        return loop(0, lq // self.bq, q_block, init)

    def backward(self, dout, lse, delta, dq):
        """(dq + this pair's part, dk, dv) in fp32, probabilities recomputed from the final lse."""
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

        def kv_block(j, carry):
            dq, dk, dv = carry
            k0 = j * self.bkv

            def q_block(i, state):
                q0 = i * self.bq
                q, k, v, visible, seen = self.block(q0, k0)

                def update(state):
                    dq, dk_j, dv_j = state
                    do = _rows(dout, q0, self.bq)
                    logits = self.logits(q, k)
                    probs = jnp.exp(masked(logits, visible) - _rows(lse, q0, self.bq, 3)[..., None])
                    dv_j = dv_j + _einsum("BGRLP,BLGRV->BPGV", probs.astype(do.dtype), do)
                    dprobs = _einsum("BLGRV,BPGV->BGRLP", do, v)
                    dlogits = probs * (dprobs - _rows(delta, q0, self.bq, 3)[..., None])
                    dscores = self.options.logits_grad(dlogits, logits, q.shape[-1])
                    dk_j = dk_j + _einsum("BGRLP,BLGRK->BPGK", dscores.astype(q.dtype), q)
                    dq_i = _einsum("BGRLP,BPGK->BLGRK", dscores.astype(k.dtype), k)
                    return lax.dynamic_update_slice_in_dim(dq, _rows(dq, q0, self.bq) + dq_i, q0, 1), dk_j, dv_j

                return lax.cond(seen, update, lambda state: state, state) if self.skips else update(state)

            zeros = lambda x: jnp.zeros((x.shape[0], self.bkv, *x.shape[2:]), f32)  # noqa: E731
            dq, dk_j, dv_j = loop(0, self.q.shape[1] // self.bq, q_block, (dq, zeros(self.k), zeros(self.v)))
            put = lambda x, block: lax.dynamic_update_slice_in_dim(x, block, k0, 1)  # noqa: E731
            return dq, put(dk, dk_j), put(dv, dv_j)

        return loop(0, self.k.shape[1] // self.bkv, kv_block, (dq, jnp.zeros(self.k.shape, f32),
                                                                jnp.zeros(self.v.shape, f32)))


def merge(o1, lse1, o2, lse2):
    """Two partial softmax results of the same queries, over disjoint keys, as one."""
    lse = jnp.logaddexp(lse1, lse2)
    finite = jnp.isfinite(lse)
    w1 = jnp.where(finite, jnp.exp(lse1 - jnp.where(finite, lse, 0.0)), 0.0)
    w2 = jnp.where(finite, jnp.exp(lse2 - jnp.where(finite, lse, 0.0)), 0.0)
    to_q = lambda w: jnp.einsum("BGRL->BLGR", w)[..., None]  # noqa: E731
    return o1 * to_q(w1) + o2 * to_q(w2), lse
