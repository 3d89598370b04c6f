"""Context parallelism: attention across a sequence split over the `context` mesh axis.

Each of the C context devices holds L / C positions of every sequence through the whole block; the
weights are replicated over `context`. Attention is the one place where positions meet, and it runs
in a `shard_map` manual over `context` (automatic over the other axes):

- `ring`: the key/value blocks go round the ring with `ppermute`, C - 1 steps, and each device
  merges the block it holds into its queries' online softmax (output and log-sum-exp). Backward
  sends each block round again with its gradient accumulators, and one last step takes them home.
- `allgather`: the keys and values are all-gathered once (grouped-query attention's few key/value
  heads make that cheap), and the same schedule reads block j from the gathered array.

Block pairs above the causal diagonal are skipped, not masked. Balanced (`parallel.context_balance`,
the default), the sequence is cut into 2C chunks and device i holds chunks i and 2C - 1 - i
(`device_order`); then at every step of the ring each device computes exactly two chunk pairs with
no mask: all its queries against the early chunk of a block from a lower rank, or its late queries
against both chunks of a block from a higher rank. Unbalanced, device i holds chunk i and computes
one full pair per lower rank besides its own diagonal one: rank C - 1 does C pairs, rank 0 one
(`blocks_per_rank` counts the block pairs computed).

Each chunk pair is computed in blocks of bq queries by bkv keys (model.flash_block_q and _kv, cut to
divide a chunk) with an online softmax in fp32, so a device's temporaries are one block of scores,
never L x L; in a diagonal pair, the blocks above the diagonal are skipped too. Scores and
probabilities are recomputed in backward from the saved log-sum-exp, as in jaxpar.model.flash.
With packed rows, every block pair also masks keys of another document (the ids of the whole
sequence are all-gathered once; they never travel round the ring).

The score options of jaxpar.model.scores apply in every block pair: scale and soft cap, and a sliding
window, under which block pairs whose every key lies out of every query's window are skipped as those
above the diagonal are (a pair's blocks hold consecutive positions, so its first and last positions
decide). The ring still takes every block round: which ranks' blocks a window reaches depends on the
rank. The sinks join each row's log-sum-exp once, after the last step, and their gradient is each
rank's rows' part summed over `context`. The values may have a head width of their own (V).

Shapes: B batch, n local positions (L / C), G key/value heads, R query heads per key/value head,
K head size (V the values'). Positions are global (where the token sits in its sequence), so masks need no offsets.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jaxpar.model.scores import PLAIN, ScoreOptions, fold_sinks, sink_share
from jaxpar.parallel.context_pair import Pair, loop, merge
from jaxpar.parallel.reductions import scattered

CONTEXT = "context"
f32 = jnp.float32


def device_order(seq_len: int, context: int, balance: bool) -> np.ndarray:
    """The positions of a sequence in the order the context devices hold them (device i: the i-th
    slice of L / C): 0 ... L-1, or balanced, chunks i and 2C - 1 - i of 2C for device i."""
    if not balance or context == 1:
        return np.arange(seq_len)
    chunks = np.arange(seq_len).reshape(2 * context, seq_len // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)])


def blocks_per_rank(seq_len: int, context: int, balance: bool, blocks: tuple[int, int], window: int = 0) -> list[int]:
    """Block pairs of attention each context rank computes per sequence (jaxpar plan's balance
    report), as the schedule below runs them with `blocks` (queries, keys) per block pair, and under
    a sliding `window` (0: none)."""
    return _Schedule(context, balance, seq_len // context, blocks).blocks_per_rank(window)


# ---------------------------------------------------------------- the schedule of a context rank

Span = tuple[int, int]


class _Schedule:
    """Which chunk pairs a rank computes against the key/value block of another: `first` against its
    own block (step 0), `low` against a block from a lower rank, `high` from a higher one. Each pair is
    (query span, key span, causal) in local positions."""

    def __init__(self, context: int, balance: bool, local: int, blocks: tuple[int, int], options: ScoreOptions = PLAIN):
        self.C, self.balance, self.local, self.options = context, balance, local, options
        self.order = device_order(local * context, context, balance).reshape(context, local).astype(np.int32)
        chunk = local // 2 if balance else local
        self.bq, self.bkv = (math.gcd(b, chunk) for b in blocks)  # every block inside one chunk

    def positions(self, rank):
        """The global positions rank `rank` holds (a constant of each trace, made there)."""
        return jnp.asarray(self.order)[rank]

    def first(self) -> list[tuple[Span, Span, bool]]:
        n, h = self.local, self.local // 2
        if self.balance:  # early q x early k, late q x both k; early q x late k lies above the diagonal
            return [((0, h), (0, h), True), ((h, n), (0, n), True)]
        return [((0, n), (0, n), True)]

    def low(self) -> list[tuple[Span, Span, bool]]:
        n, h = self.local, self.local // 2
        return [((0, n), (0, h), False)] if self.balance else [((0, n), (0, n), False)]

    def high(self) -> list[tuple[Span, Span, bool]]:
        n, h = self.local, self.local // 2
        return [((h, n), (0, n), False)] if self.balance else []

    def blocks_per_rank(self, window: int = 0) -> list[int]:
        """(bq x bkv) block pairs of attention each rank computes per sequence, as Pair visits them (in a
        causal pair, none whose keys all come after its queries, nor any out of the window): `jaxpar plan`'s
        balance report."""
        def computed(i: int, j: int, pairs) -> int:
            q_pos, k_pos = self.order[i], self.order[j]
            return sum(int((not causal or q_pos[q + self.bq - 1] >= k_pos[k])
                           and (not window or q_pos[q] - k_pos[k + self.bkv - 1] < window))
                       for qs, ks, causal in pairs
                       for q in range(qs[0], qs[1], self.bq) for k in range(ks[0], ks[1], self.bkv))

        def ring(i: int) -> int:
            later = [(i - s) % self.C for s in range(1, self.C)]
            return computed(i, i, self.first()) + sum(computed(i, j, self.low() if j < i else self.high())
                                                      for j in later)

        return [ring(i) for i in range(self.C)]


def _cut(x, span: Span, axis: int = 1):
    return None if x is None else lax.slice_in_dim(x, span[0], span[1], axis=axis)


def _chunk_pair(schedule, q, k, v, q_pos, k_pos, q_ids, k_ids, qs: Span, ks: Span, causal: bool) -> Pair:
    return Pair(_cut(q, qs), _cut(k, ks), _cut(v, ks), _cut(q_pos, qs, 0), _cut(k_pos, ks, 0), _cut(q_ids, qs),
                 _cut(k_ids, ks), causal, schedule.bq, schedule.bkv, schedule.options)


def _block_of(x, rank, C: int):
    """Rank `rank`'s block of an array gathered over `context` along axis 1."""
    return None if x is None else lax.dynamic_index_in_dim(x.reshape(x.shape[0], C, -1, *x.shape[2:]), rank, 1,
                                                           keepdims=False)


def _shift(x):
    """Each rank's x to the next rank round the ring."""
    C = lax.axis_size(CONTEXT)
    return lax.ppermute(x, CONTEXT, [(r, (r + 1) % C) for r in range(C)])


def _each_step(schedule: _Schedule, move, compute, carry):
    """The ring's steps s = 0 ... C-1: carry = compute(pairs, j, carry) against the block of rank j = i - s,
    its pairs `first` at step 0, then chosen by lax.cond on j < i (`low` or `high`). Before each later
    step carry = move(carry), outside the cond: every rank must reach the same collectives."""
    i = lax.axis_index(CONTEXT)
    carry = compute(schedule.first(), i, carry)
    high = functools.partial(compute, schedule.high()) if schedule.high() else (lambda j, carry: carry)

    def one(s, carry):
        j = (i - s) % schedule.C
        return lax.cond(j < i, functools.partial(compute, schedule.low()), high, j, move(carry))

    return loop(1, schedule.C, one, carry)


def _forward(schedule: _Schedule, ring: bool, q, k, v, ids_all, sinks):
    """(out, lse) of this rank's queries; k, v: this rank's block (ring) or every rank's (all-gather);
    sinks (G, R) or None, folded into each row's softmax once all blocks are in."""
    i = lax.axis_index(CONTEXT)
    B, n, G, R, _ = q.shape
    q_pos, q_ids = schedule.positions(i), _block_of(ids_all, i, schedule.C)

    def step(pairs, j, carry):
        k_here, v_here, o, lse = carry
        k_j, v_j = (k_here, v_here) if ring else (_block_of(k, j, schedule.C), _block_of(v, j, schedule.C))
        k_pos, k_ids = schedule.positions(j), _block_of(ids_all, j, schedule.C)
        for qs, ks, causal in pairs:
            o2, lse2 = _chunk_pair(schedule, q, k_j, v_j, q_pos, k_pos, q_ids, k_ids, qs, ks, causal).forward()
            o_q, lse_q = merge(_cut(o, qs), _cut(lse, qs, 3), o2, lse2)
            o = lax.dynamic_update_slice_in_dim(o, o_q, qs[0], 1)
            lse = lax.dynamic_update_slice_in_dim(lse, lse_q, qs[0], 3)
        return k_here, v_here, o, lse

    start = (jnp.zeros((B, n, G, R, v.shape[-1]), f32), jnp.full((B, G, R, n), -jnp.inf, f32))
    carry = (k, v, *start) if ring else ((), (), *start)
    move = (lambda c: (_shift(c[0]), _shift(c[1]), *c[2:])) if ring else (lambda c: c)
    *_, o, lse = _each_step(schedule, move, step, carry)
    if sinks is not None:
        weight, lse = fold_sinks(lse, sinks[None, :, :, None])
        o = o * jnp.einsum("BGRL->BLGR", weight)[..., None]
    return o.astype(q.dtype), lse


def _backward(schedule: _Schedule, ring: bool, q, k, v, ids_all, sinks, out, lse, dout):
    """(dq, dk, dv, this rank's part of dsinks) in the inputs' dtypes (dsinks fp32, None without sinks).
    Ring: each block goes round again with its fp32 gradient accumulators, which one more step takes
    home. All-gather: the gathered blocks' gradients."""
    i = lax.axis_index(CONTEXT)
    q_pos, q_ids = schedule.positions(i), _block_of(ids_all, i, schedule.C)
    dout = dout.astype(q.dtype)
    delta = jnp.einsum("BLGRV,BLGRV->BGRL", dout, out, preferred_element_type=f32)

    def step(pairs, j, carry):
        k_here, v_here, dk, dv, dq = carry
        k_j, v_j = (k_here, v_here) if ring else (_block_of(k, j, schedule.C), _block_of(v, j, schedule.C))
        k_pos, k_ids = schedule.positions(j), _block_of(ids_all, j, schedule.C)
        dk_j, dv_j = (dk, dv) if ring else (_block_of(dk, j, schedule.C), _block_of(dv, j, schedule.C))
        for qs, ks, causal in pairs:
            pair = _chunk_pair(schedule, q, k_j, v_j, q_pos, k_pos, q_ids, k_ids, qs, ks, causal)
            dq_q, dk2, dv2 = pair.backward(_cut(dout, qs), _cut(lse, qs, 3), _cut(delta, qs, 3), _cut(dq, qs))
            dq = lax.dynamic_update_slice_in_dim(dq, dq_q, qs[0], 1)
            dk_j = lax.dynamic_update_slice_in_dim(dk_j, _cut(dk_j, ks) + dk2, ks[0], 1)
            dv_j = lax.dynamic_update_slice_in_dim(dv_j, _cut(dv_j, ks) + dv2, ks[0], 1)
        if ring:
            return k_here, v_here, dk_j, dv_j, dq
        return k_here, v_here, _put_block(dk, dk_j, j, schedule.C), _put_block(dv, dv_j, j, schedule.C), dq

    zeros = lambda x: jnp.zeros(x.shape, f32)  # noqa: E731
    move = (lambda c: (*(_shift(x) for x in c[:4]), c[4])) if ring else (lambda c: c)
    _, _, dk, dv, dq = _each_step(schedule, move, step, (k, v, zeros(k), zeros(v), zeros(q)))
    if ring:  # block i + 1's gradients are here after the last step: one more step takes them home
        dk, dv = _shift(dk), _shift(dv)
    dsinks = None if sinks is None else sink_share(lse, sinks[None, :, :, None], delta).sum((0, 3))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks


def _put_block(x, block, rank, C: int):
    blocks = x.reshape(x.shape[0], C, -1, *x.shape[2:])
    return lax.dynamic_update_index_in_dim(blocks, block, rank, 1).reshape(x.shape)


def attention(layout, q_BLHK, k_BLGK, v_BLGV, ids_BL, blocks: tuple[int, int], options: ScoreOptions | None = None,
              sinks_H=None):
    """Causal attention of q (B, L, H, K) over k (B, L, G, K) and v (B, L, G, V), their L split over
    `context` in `device_order`, by the layout's parallel.context_attention; ids_BL: packed rows'
    document ids (in the same order), or None. `blocks`: (queries, keys) per block pair; `options`:
    window, soft cap and scale (None: plain); sinks_H: each query head's sink logit (H,), or None.
    Output (B, L, H, V).

    A custom VJP around two shard_maps, forward and backward: autodiff never enters the shard_maps."""
    inside = jax.sharding.get_abstract_mesh()  # in the experts' shard_map: its mesh, some axes manual
    mesh = layout.mesh if inside.empty else inside
    C = mesh.shape[CONTEXT]
    _, L, H, _ = q_BLHK.shape
    G, local = k_BLGK.shape[2], L // C
    schedule = _Schedule(C, layout.balanced_context, local, blocks, options or PLAIN)
    ring = layout.context_attention == "ring"
    seq, lse_spec = PartitionSpec(None, CONTEXT), PartitionSpec(None, None, None, CONTEXT)
    mapped = functools.partial(jax.shard_map, mesh=mesh, axis_names={CONTEXT}, check_vma=False)
    ids_spec, sinks_spec = (None if ids_BL is None else seq), (None if sinks_H is None else PartitionSpec())

    def to_groups(x):  # (B, n, H, K) -> (B, n, G, R, K): the query heads that read each key/value head
        return x.reshape(*x.shape[:2], G, H // G, x.shape[-1])

    def sink_groups(sinks):  # (H,) -> (G, R)
        return _maybe(lambda x: x.reshape(G, H // G), sinks)

    def forward_body(q, k, v, ids, sinks):
        out, lse = _forward(schedule, ring, to_groups(q), *_gathered(ring, k, v, ids), sink_groups(sinks))
        return out.reshape(*out.shape[:2], H, out.shape[-1]), lse

    def backward_body(q, k, v, ids, sinks, out, lse, dout):
        k_all, v_all, ids_all = _gathered(ring, k, v, ids)
        dq, dk, dv, dsinks = _backward(schedule, ring, to_groups(q), k_all, v_all, ids_all, sink_groups(sinks),
                                       to_groups(out), lse, to_groups(dout))
        if not ring:  # the all-gather's transpose: each rank's block, summed over the ranks (in fp32: no bf16
            # reduce-scatter, which XLA:CPU aborts on, jaxpar.parallel.reductions)
            dk, dv = (scattered(x, CONTEXT, 1, x.dtype).astype(x.dtype) for x in (dk, dv))
        dsinks = _maybe(lambda d: lax.psum(d, CONTEXT).reshape(H).astype(sinks.dtype), dsinks)  # every rank's rows
        return dq.reshape(q.shape), dk, dv, dsinks

    forward = mapped(forward_body, in_specs=(seq, seq, seq, ids_spec, sinks_spec), out_specs=(seq, lse_spec))
    backward = mapped(backward_body, in_specs=(seq, seq, seq, ids_spec, sinks_spec, seq, lse_spec, seq),
                      out_specs=(seq, seq, seq, sinks_spec))

    @jax.custom_vjp
    def attend(q, k, v, ids, sinks):
        return forward(q, k, v, ids, sinks)[0]

    def attend_fwd(q, k, v, ids, sinks):
        out, lse = forward(q, k, v, ids, sinks)
        return out, (q, k, v, ids, sinks, out, lse)

    def attend_bwd(residuals, dout):
        dq, dk, dv, dsinks = backward(*residuals, dout)
        return dq, dk, dv, None, dsinks

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q_BLHK, k_BLGK, v_BLGV, ids_BL, sinks_H)


def _gathered(ring: bool, k, v, ids):
    """Every rank's document ids, and for the all-gather every rank's keys and values."""
    ids_all = None if ids is None else lax.all_gather(ids, CONTEXT, axis=1, tiled=True)
    if not ring:
        k, v = (lax.all_gather(x, CONTEXT, axis=1, tiled=True) for x in (k, v))
    return k, v, ids_all


def _maybe(fn, x):
    return None if x is None else fn(x)
