"""Pipeline executors, run per device inside `jax.shard_map` (manual over the `stage` axis).

Each device holds its stages' layers (the stacked weights are sharded over `stage` on the
layers dimension). Neighbouring stages exchange activations (forward) and their cotangents
(backward) with `ppermute`; the embedding runs on the first stage and the head and loss on
the last, so a backward can start on the last stage as soon as its forward is done.

- GPipe: a scan over the table's forward ticks, differentiated by autodiff, which gives the
  all-forwards-then-all-backwards order and keeps activations for all M microbatches.
- 1F1B, interleaved 1F1B and 2BW: a scan over every tick of the table. A forward tick runs
  the chunk and keeps only its input; a backward tick recomputes the chunk from that input
  with `jax.vjp` and applies the received cotangent, so at most the table's in-flight bound
  of inputs is stored per device, not M.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.schedules import Table

IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The model cut for pipelining. Parameters are the whole tree; stacked leaves hold only the
    layers of the chunk being run.

    embed(params, tokens_bT) -> x_bLD            first chunk's input
    layers(params, x_bLD) -> x_bLD               the chunk's layers
    head_loss(params, x_bLD, tokens_bT) -> loss  last chunk: mean loss of the microbatch
    """

    embed: Callable
    layers: Callable
    head_loss: Callable


def _action_arrays(table: Table, ticks: int | None = None):
    kind = np.zeros((len(table.ticks), table.stages), np.int32)
    micro = np.zeros_like(kind)
    chunk = np.zeros_like(kind)
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            if action is not None:
                kind[t, s] = FORWARD if action.kind == "F" else BACKWARD
                micro[t, s], chunk[t, s] = action.microbatch, action.chunk
    n = ticks or len(table.ticks)
    return jnp.asarray(kind[:n]), jnp.asarray(micro[:n]), jnp.asarray(chunk[:n])


def _chunk_params(params, is_stacked, local_chunk, layers_per_chunk: int):
    """The params tree with stacked leaves cut to one local chunk's layers."""
    return jax.tree.map(
        lambda p, stacked: jax.lax.dynamic_slice_in_dim(p, local_chunk * layers_per_chunk, layers_per_chunk)
        if stacked else p, params, is_stacked)


def _chunk_fn(fns: StageFns, table: Table):
    """run(chunk_params, x_in, tokens, chunk) -> (y, loss): embedding on chunk 0, head on the last."""
    last = table.stages * table.virtual - 1

    def run(chunk_params, x_in, tokens_bT, chunk):
        x = jax.lax.cond(chunk == 0, lambda: fns.embed(chunk_params, tokens_bT), lambda: x_in)
        y = fns.layers(chunk_params, x)
        loss = jax.lax.cond(chunk == last, lambda: fns.head_loss(chunk_params, y, tokens_bT).astype(jnp.float32),
                            lambda: jnp.zeros((), jnp.float32))
        return y, loss

    return run


def gpipe_value_and_grad(fns: StageFns, params, is_stacked, tokens_MbT, table: Table, axis: str = "stage"):
    """GPipe: forward ticks from the table, backward by autodiff. Returns this device's
    (loss, grads); the loss is nonzero only on the last stage."""
    S, M = table.stages, table.microbatches
    forward_ticks = M + S - 1
    kind, micro, _ = _action_arrays(table, forward_ticks)
    s = jax.lax.axis_index(axis)
    run = _chunk_fn(fns, table)
    x_shape = jax.eval_shape(fns.embed, params, tokens_MbT[0])

    def local_loss(params):
        def tick(carry, t):
            x_recv, loss_sum = carry
            active = kind[t, s] == FORWARD
            m = micro[t, s]
            y, loss = jax.lax.cond(active, lambda: run(params, x_recv, tokens_MbT[m], s),
                                   lambda: (jnp.zeros(x_shape.shape, x_shape.dtype), jnp.zeros((), jnp.float32)))
            x_next = jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(S - 1)])
            return (x_next, loss_sum + loss), None

        init = (jnp.zeros(x_shape.shape, x_shape.dtype), jnp.zeros((), jnp.float32))
        (_, loss_sum), _ = jax.lax.scan(tick, init, jnp.arange(forward_ticks))
        return loss_sum / M

    return jax.value_and_grad(local_loss)(params)


def stash_size(table: Table) -> int:
    """Fewest slots K such that slot = microbatch % K never overwrites a live input or cotangent.

    A chunk's input is live from the tick its predecessor chunk's forward sent it (its own
    forward, for chunk 0) until its backward; a cotangent from the successor's backward
    until this chunk's backward.
    """
    done = {}
    for t, row in enumerate(table.ticks):
        for action in row:
            if action is not None:
                done[action] = t
    last = table.stages * table.virtual - 1
    spans = {"x": [], "g": []}  # (stage, local chunk, microbatch, start, end)
    for action, t in done.items():
        if action.kind != "B":
            continue
        i, k = action.microbatch, action.chunk
        where = (k % table.stages, k // table.stages, i)
        spans["x"].append(where + (done[type(action)("F", i, k - 1)] if k > 0 else done[type(action)("F", i, k)], t))
        if k < last:
            spans["g"].append(where + (done[type(action)("B", i, k + 1)], t))
    for K in range(1, table.microbatches + 1):
        if all(_no_overlap(span_list, K) for span_list in spans.values()):
            return K
    return table.microbatches


def _no_overlap(spans, K: int) -> bool:
    by_slot: dict[tuple, list[tuple[int, int]]] = {}
    for stage, local_chunk, micro, start, end in spans:
        by_slot.setdefault((stage, local_chunk, micro % K), []).append((start, end))
    for intervals in by_slot.values():
        intervals.sort()
        if any(later[0] <= earlier[1] for earlier, later in zip(intervals, intervals[1:])):
            return False
    return True


def one_f_one_b_value_and_grad(fns: StageFns, params, is_stacked, tokens_MbT, table: Table, axis: str = "stage"):
    """1F1B / interleaved / 2BW: every tick of the table, explicit per-tick backward.
    Returns this device's (loss, grads); the loss is nonzero only on the last stage."""
    S, M, v = table.stages, table.microbatches, table.virtual
    last_chunk = S * v - 1
    kind, micro, chunk = _action_arrays(table)
    K = stash_size(table)
    s = jax.lax.axis_index(axis)
    local_layers = jax.tree.leaves(jax.tree.map(lambda p, st: p.shape[0] if st else None, params, is_stacked))[0]
    layers_per_chunk = local_layers // v
    run = _chunk_fn(fns, table)
    x_aval = jax.eval_shape(fns.embed, params, tokens_MbT[0])
    zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
    ring = S > 1 and v > 1  # interleaved chunks wrap from the last device back to the first
    forward_perm = [(i, (i + 1) % S) for i in range(S if ring else S - 1)]
    backward_perm = [((i + 1) % S, i) for i in range(S if ring else S - 1)]

    def add_chunk_grads(grads, chunk_grads, local_chunk):
        return jax.tree.map(
            lambda g, cg, stacked: jax.lax.dynamic_update_slice_in_dim(
                g, jax.lax.dynamic_slice_in_dim(g, local_chunk * layers_per_chunk, layers_per_chunk) + cg,
                local_chunk * layers_per_chunk, 0) if stacked else g + cg, grads, chunk_grads, is_stacked)

    def tick(carry, t):
        stash_x, stash_g, grads, loss_sum = carry
        m, c = micro[t, s], chunk[t, s]
        local_chunk = c // S
        slot = (m % K, local_chunk)
        tokens = tokens_MbT[m]
        chunk_params = _chunk_params(params, is_stacked, local_chunk, layers_per_chunk)

        def idle():
            return grads, loss_sum, zeros_x, zeros_x

        def forward():
            y, loss = run(chunk_params, stash_x[slot], tokens, c)
            return grads, loss_sum + loss, y, zeros_x

        def backward():
            _, vjp = jax.vjp(lambda p, x: run(p, x, tokens, c), chunk_params, stash_x[slot])
            is_last = c == last_chunk
            dy = jnp.where(is_last, jnp.zeros_like(zeros_x), stash_g[slot])
            dloss = jnp.where(is_last, 1.0 / M, 0.0).astype(jnp.float32)
            chunk_grads, dx = vjp((dy, dloss))
            return add_chunk_grads(grads, chunk_grads, local_chunk), loss_sum, zeros_x, dx

        grads, loss_sum, out_f, out_b = jax.lax.switch(kind[t, s], [idle, forward, backward])
        recv_f = jax.lax.ppermute(out_f, axis, forward_perm)
        recv_b = jax.lax.ppermute(out_b, axis, backward_perm)
        # What arrived is known from the table: the neighbours' actions at this tick.
        prev, nxt = (s - 1) % S, (s + 1) % S
        got_f = (kind[t, prev] == FORWARD) & (chunk[t, prev] < last_chunk) & ((s > 0) | ring)
        f_slot = (micro[t, prev] % K, (chunk[t, prev] + 1) // S)
        stash_x = stash_x.at[f_slot].set(jnp.where(got_f, recv_f, stash_x[f_slot]))
        got_b = (kind[t, nxt] == BACKWARD) & (chunk[t, nxt] > 0) & ((s < S - 1) | ring)
        b_slot = (micro[t, nxt] % K, (chunk[t, nxt] - 1) // S)
        stash_g = stash_g.at[b_slot].set(jnp.where(got_b, recv_b, stash_g[b_slot]))
        return (stash_x, stash_g, grads, loss_sum), None

    stash = jnp.zeros((K, v) + x_aval.shape, x_aval.dtype)
    grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (stash, stash, grads0, jnp.zeros((), jnp.float32))
    (_, _, grads, loss_sum), _ = jax.lax.scan(tick, init, jnp.arange(len(table.ticks)))
    return loss_sum / M, grads
