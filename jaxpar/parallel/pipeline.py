"""Pipeline executors, run per device inside `jax.shard_map` (manual over the `stage` axis).

Each device holds its stages' layers (the stacked weights are sharded over `stage` on the
layers dimension). Neighbouring stages exchange activations (forward) and their cotangents
(backward) with `ppermute`; the embedding runs on the first stage and the head and loss on
the last, so a backward can start on the last stage as soon as its forward is done.

Every tick is one `lax.switch` over the branch the schedule table gives each device
(`BRANCHES`): idle, or a forward or backward of the first, a middle or the last chunk. So the
embedding and the head run only where the table puts them, and the compiled branches can be
costed one by one (`jaxpar plan`'s executed FLOPs).

- GPipe: a scan over the table's forward ticks, differentiated by autodiff, which gives the
  all-forwards-then-all-backwards order and keeps activations for all M microbatches.
- 1F1B, interleaved 1F1B and 2BW: a scan over every tick of the table, with an explicit
  backward. By default a forward tick keeps the residuals of its `jax.vjp` (what backward
  needs; the weights themselves are not copied) in a buffer slot per in-flight microbatch, so
  memory stays bounded by the schedule, and a backward tick applies the received cotangent
  to them: no forward runs twice. With `recompute`, a forward tick keeps only the chunk's
  input and the backward tick recomputes the chunk from it (4/3 of the FLOPs, least memory).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.schedules import Table, stash_size

# The switch branches of a tick. GPipe's forward scan uses the first four; its transpose (by
# autodiff) takes the same index.
BRANCHES = ("idle", "forward first", "forward middle", "forward last",
            "backward first", "backward middle", "backward last")
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST = range(len(BRANCHES))
# Name scope of the tick switch, found again in the compiled program's metadata.
TICK_SCOPE = "pipeline_tick"


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The model cut for pipelining. Parameters are the whole tree; stacked leaves hold only the
    layers of the chunk being run. `rows` is a microbatch's per-row input besides its tokens (the
    routing-noise keys, or None).

    cast(params) -> params                                 the weights in the compute dtype
    embed(params, tokens_bT) -> x_bLD                      first chunk's input
    layers(params, x_bLD, layer_ids, rows)
        -> ((x_bLD, aux_loss), stats)                      the chunk's layers (layer_ids: their
                                                           model-order indices); aux_loss joins the
                                                           objective, stats (sums over the chunk's
                                                           layers) are only reported
    head_loss(params, x_bLD, tokens_bT) -> loss            last chunk: mean loss of the microbatch
    """

    cast: Callable
    embed: Callable
    layers: Callable
    head_loss: Callable


def branch_of(action, last_chunk: int) -> int:
    """The switch branch that runs `action` (None: idle)."""
    if action is None:
        return IDLE
    place = 0 if action.chunk == 0 else 2 if action.chunk == last_chunk else 1
    return (F_FIRST if action.kind == "F" else B_FIRST) + place


def switch_ticks(table: Table) -> int:
    """How many ticks the executor's tick switch runs: GPipe scans the forward ticks only (its
    backward is their transpose), the other schedules every tick of the table."""
    return table.microbatches + table.stages - 1 if table.schedule == "gpipe" else len(table.ticks)


def branch_counts(table: Table) -> np.ndarray:
    """(stages, len(BRANCHES)): how many times each device takes each branch of the tick switch."""
    last = table.stages * table.virtual - 1
    counts = np.zeros((table.stages, len(BRANCHES)), np.int64)
    for row in table.ticks[:switch_ticks(table)]:
        for s, action in enumerate(row):
            counts[s, branch_of(action, last)] += 1
    return counts


def _action_arrays(table: Table, ticks: int | None = None):
    last = table.stages * table.virtual - 1
    branch = np.zeros((len(table.ticks), table.stages), np.int32)
    micro = np.zeros_like(branch)
    chunk = np.zeros_like(branch)
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            branch[t, s] = branch_of(action, last)
            if action is not None:
                micro[t, s], chunk[t, s] = action.microbatch, action.chunk
    n = ticks or len(table.ticks)
    return jnp.asarray(branch[:n]), jnp.asarray(micro[:n]), jnp.asarray(chunk[:n])


def _chunk_params(params, is_stacked, local_chunk, layers_per_chunk: int):
    """The params tree with stacked leaves cut to one local chunk's layers."""
    return jax.tree.map(
        lambda p, stacked: jax.lax.dynamic_slice_in_dim(p, local_chunk * layers_per_chunk, layers_per_chunk)
        if stacked else p, params, is_stacked)


def _local_layers(params, is_stacked) -> int:
    return jax.tree.leaves(jax.tree.map(lambda p, st: p.shape[0] if st else None, params, is_stacked))[0]


def _microbatch(batch_M, m):
    """Microbatch m of (tokens_MbT, rows_Mb...) (rows may be None)."""
    return jax.tree.map(lambda a: a[m], batch_M)


def _zeros_like_shapes(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def gpipe_value_and_grad(fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table, axis: str = "stage"):
    """GPipe: forward ticks from the table, backward by autodiff. batch_M: (tokens_MbT, rows_Mb);
    layer_ids: this device's stacked layers' model-order indices. Returns this device's
    (share of the mean loss, sums of the layers' stats, grads); the shares of all stages sum to
    the mean loss.

    All forwards finish before any backward, so the head and loss need not wait on the last
    stage: after the forward ticks the last chunk's outputs reach every stage (one psum of
    activations) and each stage runs the head for microbatches s, s+S, ... The head (with a
    large vocabulary, the costliest matmuls of the model) is spread over the stages instead
    of doubling the last stage's work."""
    S, M = table.stages, table.microbatches
    tokens_MbT, _ = batch_M
    forward_ticks = switch_ticks(table)
    branch, micro, _ = _action_arrays(table, forward_ticks)
    s = jax.lax.axis_index(axis)
    x_shape = jax.eval_shape(fns.embed, params, tokens_MbT[0])
    stats_shape = jax.eval_shape(lambda p, x, b: fns.layers(p, x, layer_ids, b[1])[1], params, x_shape,
                                 _microbatch(batch_M, 0))

    def local_loss(params):
        params = fns.cast(params)
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        no_stats = _zeros_like_shapes(stats_shape)

        def tick(carry, t):
            x_recv, outputs, aux_sum, stats_sum = carry
            m = micro[t, s]
            tokens, rows = _microbatch(batch_M, m)

            def run(x):
                (y, aux), stats = fns.layers(params, x, layer_ids, rows)
                return y, aux.astype(jnp.float32), stats

            branches = [
                lambda: (zeros_x, jnp.zeros((), jnp.float32), no_stats),
                lambda: run(fns.embed(params, tokens)),
                lambda: run(x_recv),
                lambda: run(x_recv),
            ]
            with jax.named_scope(TICK_SCOPE):
                y, aux, stats = jax.lax.switch(branch[t, s], branches)
            # the last chunk's outputs are kept; every other tick writes the spare slot M
            outputs = outputs.at[jnp.where(branch[t, s] == F_LAST, m, M)].set(y)
            x_next = jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(S - 1)])
            return (x_next, outputs, aux_sum + aux, jax.tree.map(jnp.add, stats_sum, stats)), None

        outputs = jnp.zeros((M + 1,) + x_shape.shape, x_shape.dtype)
        init = (zeros_x, outputs, jnp.zeros((), jnp.float32), no_stats)
        (_, outputs, aux_sum, stats_sum), _ = jax.lax.scan(tick, init, jnp.arange(forward_ticks))
        # (summed in fp32: in bf16, with the batch axes manual, XLA:CPU aborted on this psum with
        # "Invalid binary instruction opcode copy")
        last = jnp.where(s == S - 1, outputs[:M], jnp.zeros_like(outputs[:M])).astype(jnp.float32)
        outputs = jax.lax.psum(last, axis).astype(x_shape.dtype)
        loss_sum = jnp.zeros((), jnp.float32)
        for j in range(-(-M // S)):
            m = j * S + s
            mine = jnp.minimum(m, M - 1)
            loss = fns.head_loss(params, outputs[mine], tokens_MbT[mine]).astype(jnp.float32)
            loss_sum += jnp.where(m < M, loss, 0.0)
        return (loss_sum + aux_sum) / M, (loss_sum / M, stats_sum)

    (_, (loss, stats)), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
    return loss, stats, grads


class _Residuals:
    """What a `jax.vjp` keeps for backward, as a list of arrays that can be stored, minus the
    weights themselves (backward takes them from the step's parameters instead).

    fn(params, x, *consts) -> (out, stats) is differentiated with respect to params and x;
    `split` runs the forward and returns its output, stats and the storable residuals;
    `pullback` rebuilds the vjp from stored residuals. The vjp's structure comes from tracing
    the same forward again inside the backward branch; that forward's results are unused
    there, and the compiler drops it as dead code.
    """

    def __init__(self, fn: Callable):
        self.fn = fn

    def _trace(self, params, x, *consts):
        out, vjp, stats = jax.vjp(lambda p, x: self.fn(p, x, *consts), params, x, has_aux=True)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        weights = {id(w): i for i, w in enumerate(jax.tree.leaves(params))}
        is_weight = [weights.get(id(leaf)) for leaf in leaves]
        return out, stats, leaves, tree, is_weight

    def split(self, params, x, *consts):
        out, stats, leaves, _, is_weight = self._trace(params, x, *consts)
        return out, stats, [leaf for leaf, w in zip(leaves, is_weight) if w is None]

    def shapes(self, params, x, *consts) -> list:
        """Shapes and dtypes of the storable residuals."""
        return jax.eval_shape(lambda *a: self.split(*a)[2], params, x, *consts)

    def pullback(self, stored: list, params, x, *consts):
        _, _, _, tree, is_weight = self._trace(params, x, *consts)
        weights, stored = jax.tree.leaves(params), iter(stored)
        return tree.unflatten([next(stored) if w is None else weights[w] for w in is_weight])


def one_f_one_b_value_and_grad(fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table,
                               axis: str = "stage", recompute: bool = False):
    """1F1B / interleaved / 2BW: every tick of the table, explicit per-tick backward.
    batch_M: (tokens_MbT, rows_Mb); layer_ids: this device's stacked layers' model-order indices.
    Returns this device's (share of the mean loss, sums of the layers' stats, grads); the loss
    is nonzero only on the last stage."""
    S, M, v = table.stages, table.microbatches, table.virtual
    tokens_MbT, _ = batch_M
    branch, micro, chunk = _action_arrays(table)
    K = stash_size(table)
    s = jax.lax.axis_index(axis)
    layers_per_chunk = _local_layers(params, is_stacked) // v
    compute = fns.cast(params)  # once per step; residuals refer to these weights, never copy them
    x_aval = jax.eval_shape(fns.embed, compute, tokens_MbT[0])
    zeros_x = jnp.zeros(x_aval.shape, x_aval.dtype)
    no_loss = jnp.zeros((), jnp.float32)
    d_aux = jnp.asarray(1.0 / M, jnp.float32)  # the objective is the mean over microbatches
    ring = S > 1 and v > 1  # interleaved chunks wrap from the last device back to the first
    forward_perm = [(i, (i + 1) % S) for i in range(S if ring else S - 1)]
    backward_perm = [((i + 1) % S, i) for i in range(S if ring else S - 1)]

    embed = _Residuals(lambda p, tokens: (fns.embed(p, tokens), {}))
    layers = _Residuals(lambda p, x, ids, rows: fns.layers(p, x, ids, rows))
    head = _Residuals(lambda p, y, tokens: (fns.head_loss(p, y, tokens).astype(jnp.float32), {}))
    chunk0 = _chunk_params(compute, is_stacked, 0, layers_per_chunk)
    ids0, (tokens0, rows0) = layer_ids[:layers_per_chunk], _microbatch(batch_M, 0)
    stats_shape = jax.eval_shape(lambda *a: layers.split(*a)[1], chunk0, zeros_x, ids0, rows0)
    no_stats = _zeros_like_shapes(stats_shape)
    kept = {} if recompute else {
        "embed": embed.shapes(compute, tokens0),
        "layers": layers.shapes(chunk0, zeros_x, ids0, rows0),
        "head": head.shapes(compute, zeros_x, tokens0),
    }
    # K slots per local chunk, plus one slot that ticks with nothing to keep write into.
    stash_res = {name: [jnp.zeros((K + 1, v) + r.shape, r.dtype) for r in shapes] for name, shapes in kept.items()}
    no_res = {name: [jnp.zeros(r.shape, r.dtype) for r in shapes] for name, shapes in kept.items()}

    def add_chunk_grads(grads, chunk_grads, local_chunk):
        return jax.tree.map(
            lambda g, cg, stacked: jax.lax.dynamic_update_slice_in_dim(
                g, jax.lax.dynamic_slice_in_dim(g, local_chunk * layers_per_chunk, layers_per_chunk)
                + cg.astype(g.dtype), local_chunk * layers_per_chunk, 0) if stacked else g + cg.astype(g.dtype),
            grads, chunk_grads, is_stacked)

    def tick(carry, t):
        stash_x, stash_g, stash_res, grads, loss_sum, stats_sum = carry
        b, m, c = branch[t, s], micro[t, s], chunk[t, s]
        local_chunk = c // S
        slot = (m % K, local_chunk)
        tokens, rows = _microbatch(batch_M, m)
        ids = jax.lax.dynamic_slice_in_dim(layer_ids, local_chunk * layers_per_chunk, layers_per_chunk)
        p = _chunk_params(compute, is_stacked, local_chunk, layers_per_chunk)

        def whole(p, x, first: bool, last: bool):
            """The chunk as one function for recomputation: ((output, aux), stats), or on the last
            chunk (loss + aux, stats)."""
            (y, aux), stats = fns.layers(p, fns.embed(p, tokens) if first else x, ids, rows)
            if last:
                return fns.head_loss(p, y, tokens).astype(jnp.float32) + aux, stats
            return (y, aux), stats

        def forward(first: bool, last: bool):
            def run():
                res, x, loss = dict(no_res), stash_x[slot], no_loss
                if recompute:  # keep nothing but the input (already in stash_x)
                    (y, _), stats = fns.layers(p, fns.embed(p, tokens) if first else x, ids, rows)
                    if last:
                        loss, y = fns.head_loss(p, y, tokens).astype(jnp.float32), zeros_x
                else:
                    if first:
                        x, _, res["embed"] = embed.split(p, tokens)
                    (y, _), stats, res["layers"] = layers.split(p, x, ids, rows)
                    if last:
                        loss, _, res["head"] = head.split(p, y, tokens)
                        y = zeros_x
                return grads, loss_sum + loss, jax.tree.map(jnp.add, stats_sum, stats), y, zeros_x, res
            return run

        def backward(first: bool, last: bool):
            def run():
                x_in = stash_x[slot]
                if recompute:
                    _, vjp, _ = jax.vjp(lambda p, x: whole(p, x, first, last), p, x_in, has_aux=True)
                    chunk_grads, dx = vjp(d_aux if last else (stash_g[slot], d_aux))
                else:
                    stored = {name: [buf[slot] for buf in bufs] for name, bufs in stash_res.items()}
                    chunk_grads, dy = jax.tree.map(jnp.zeros_like, p), stash_g[slot]
                    if last:
                        chunk_grads, dy = head.pullback(stored["head"], p, zeros_x, tokens)(d_aux)
                    layer_grads, dx = layers.pullback(stored["layers"], p, zeros_x, ids, rows)((dy, d_aux))
                    chunk_grads = jax.tree.map(jnp.add, chunk_grads, layer_grads)
                    if first:
                        embed_grads, _ = embed.pullback(stored["embed"], p, tokens)(dx)
                        chunk_grads = jax.tree.map(jnp.add, chunk_grads, embed_grads)
                return (add_chunk_grads(grads, chunk_grads, local_chunk), loss_sum, stats_sum, zeros_x,
                        zeros_x if first else dx, no_res)
            return run

        def idle():
            return grads, loss_sum, stats_sum, zeros_x, zeros_x, no_res

        branches = [idle, forward(True, False), forward(False, False), forward(False, True),
                    backward(True, False), backward(False, False), backward(False, True)]
        with jax.named_scope(TICK_SCOPE):
            grads, loss_sum, stats_sum, out_f, out_b, res = jax.lax.switch(b, branches)
        # A forward's residuals go to its slot; every other tick writes the spare slot K.
        keep_slot = (jnp.where((b >= F_FIRST) & (b <= F_LAST), m % K, K), local_chunk)
        stash_res = {name: [buf.at[keep_slot].set(r) for buf, r in zip(bufs, res[name])]
                     for name, bufs in stash_res.items()}
        recv_f = jax.lax.ppermute(out_f, axis, forward_perm)
        recv_b = jax.lax.ppermute(out_b, axis, backward_perm)
        # What arrived is known from the table: the neighbours' actions at this tick.
        prev, nxt = (s - 1) % S, (s + 1) % S
        got_f = ((branch[t, prev] == F_FIRST) | (branch[t, prev] == F_MID)) & ((s > 0) | ring)
        f_slot = (micro[t, prev] % K, (chunk[t, prev] + 1) // S)
        stash_x = stash_x.at[f_slot].set(jnp.where(got_f, recv_f, stash_x[f_slot]))
        got_b = ((branch[t, nxt] == B_MID) | (branch[t, nxt] == B_LAST)) & ((s < S - 1) | ring)
        b_slot = (micro[t, nxt] % K, (chunk[t, nxt] - 1) // S)
        stash_g = stash_g.at[b_slot].set(jnp.where(got_b, recv_b, stash_g[b_slot]))
        return (stash_x, stash_g, stash_res, grads, loss_sum, stats_sum), None

    stash = jnp.zeros((K, v) + x_aval.shape, x_aval.dtype)
    grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    init = (stash, stash, stash_res, grads0, no_loss, no_stats)
    (_, _, _, grads, loss_sum, stats_sum), _ = jax.lax.scan(tick, init, jnp.arange(len(table.ticks)))
    return loss_sum / M, stats_sum, grads
