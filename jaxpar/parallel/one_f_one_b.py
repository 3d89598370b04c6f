"""1F1B, interleaved 1F1B, PipeDream-2BW and naive model parallelism: every tick of the table in a
scan, with an explicit backward. By default a forward tick keeps the residuals of its `jax.vjp`
(what backward needs; the weights themselves are not copied) in a stash slot per in-flight
microbatch, so memory stays bounded by the schedule, and a backward tick applies the received
cotangent to them: no forward runs twice. With `recompute`, a forward tick keeps only the chunk's
input and the backward tick recomputes the chunk from it (4/3 of the FLOPs, least memory)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.model.adapters import zero_grad
from jaxpar.parallel import pipeline
from jaxpar.parallel.pipeline import (
    B_FIRST,
    B_LAST,
    B_MID,
    F_FIRST,
    F_LAST,
    F_MID,
    FIRST_CHUNK_SCOPE,
    LAST_CHUNK_SCOPE,
    TICK_SCOPE,
    Residuals,
    StageFns,
    action_arrays,
    chunk_params,
    head_part,
    local_layers,
    microbatch,
    probe,
    stash_write,
    switch_index,
    zeros_like_shapes,
)
from jaxpar.parallel.schedules import Table, stash_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stash:
    """What a device keeps between the ticks of a 1F1B-type schedule, by (slot, local chunk): each
    in-flight chunk's input `x` and its output's cotangent `g` as they arrive from the neighbours,
    and (unless recomputing) the residuals its forward kept for its backward, a list of buffers
    per part ("embed", "layers", "head") with one spare slot that ticks with nothing to keep
    write into."""

    x: jax.Array
    g: jax.Array
    residuals: dict


@dataclasses.dataclass(frozen=True)
class _TickInputs:
    """What one tick's branch works on: the chunk's weights, microbatch and layer ids, the stash and
    its slot (read inside the branch that needs it), and the sums so far."""

    p: object
    tokens: jax.Array
    rows: object
    ids: jax.Array
    local_chunk: jax.Array
    stash: Stash
    slot: tuple
    grads: object
    loss_sum: jax.Array
    stats_sum: object

    @property
    def x_in(self) -> jax.Array:
        """The chunk's stashed input."""
        return pipeline.stash_read(self.stash.x, self.slot)

    @property
    def g_in(self) -> jax.Array:
        """The stashed cotangent of the chunk's output."""
        return pipeline.stash_read(self.stash.g, self.slot)

    @property
    def stored(self) -> dict:
        """The residuals the chunk's forward kept."""
        residuals = self.stash.residuals.items()
        return {name: [pipeline.stash_read(buf, self.slot) for buf in bufs] for name, bufs in residuals}


class _OneFOneB:
    """1F1B / interleaved / 2BW on one device: every tick of the table in a `lax.scan`, each a
    `lax.switch` over idle, a chunk's forward and its backward (the embedding on the first chunk and
    the head on the last in conds inside them), with an explicit backward from kept residuals (or,
    with `recompute`, from the chunk's input)."""

    def __init__(self, fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table, axis: str,
                 recompute: bool):
        self.fns, self.is_stacked, self.batch_M, self.layer_ids = fns, is_stacked, batch_M, layer_ids
        self.table, self.axis, self.recompute = table, axis, recompute
        S, v = table.stages, table.virtual
        self.K = self.stash_slots(table)
        self.s = jax.lax.axis_index(axis)
        self.layers_per_chunk = local_layers(params, is_stacked) // v
        self.compute = fns.cast(params)  # once per step; residuals refer to these weights, never copy them
        self.branch, self.micro, self.chunk = action_arrays(table)
        tokens0, rows0, self.zeros_x = probe(fns, self.compute, batch_M)
        self.d_aux = jnp.asarray(1.0 / table.microbatches, jnp.float32)  # the objective is the mean over microbatches
        self.ring = S > 1 and v > 1  # interleaved chunks wrap from the last device back to the first
        self.forward_perm = [(i, (i + 1) % S) for i in range(S if self.ring else S - 1)]
        self.backward_perm = [((i + 1) % S, i) for i in range(S if self.ring else S - 1)]
        self.embed = Residuals(lambda p, tokens: (fns.embed(p, tokens), {}))
        self.layers = Residuals(lambda p, x, ids, rows: fns.layers(p, x, ids, rows))
        self.head = head_part(fns)
        chunk0 = chunk_params(self.compute, is_stacked, 0, self.layers_per_chunk)
        ids0 = layer_ids[:self.layers_per_chunk]
        stats_shape = jax.eval_shape(lambda *a: self.layers.split(*a)[1], chunk0, self.zeros_x, ids0, rows0)
        self.no_head_stats = zeros_like_shapes(jax.eval_shape(lambda *a: self.head.split(*a)[1], self.compute,
                                                              self.zeros_x, tokens0))
        self.no_stats = (zeros_like_shapes(stats_shape), self.no_head_stats)
        kept = {
            "embed": self.embed.shapes(self.compute, tokens0),
            "layers": self.layers.shapes(chunk0, self.zeros_x, ids0, rows0),
            "head": self.head.shapes(self.compute, self.zeros_x, tokens0),
        }
        self.no_res = {name: [jnp.zeros(r.shape, r.dtype) for r in shapes] for name, shapes in kept.items()}
        self.kept = {} if recompute else kept  # what the stash holds
        self.no_kept = {name: self.no_res[name] for name in self.kept}  # what ticks that keep nothing write

    @staticmethod
    def stash_slots(table: Table) -> int:
        """Slots per in-flight value: the fewest that the table never overwrites while live."""
        return stash_size(table)

    def weights_for(self, m):
        """The weights (compute dtype) that microbatch m runs on: the step's."""
        return self.compute

    def rows_for(self, m):
        """Microbatch m's tokens and rows."""
        return microbatch(self.batch_M, m)

    def run(self, params):
        """(this device's share of the mean loss, (sums of the layers' stats, of the head's), grads)."""
        v, M = self.table.virtual, self.table.microbatches
        empty = jnp.zeros((self.K, v) + self.zeros_x.shape, self.zeros_x.dtype)
        residuals = {name: [jnp.zeros((self.K + 1, v) + r.shape, r.dtype) for r in shapes]
                     for name, shapes in self.kept.items()}
        grads0 = jax.tree.map(zero_grad, params)  # a frozen weight's: zero-size float0
        init = (Stash(empty, empty, residuals), grads0, jnp.zeros((), jnp.float32), self.no_stats)
        (_, grads, loss_sum, stats_sum), _ = jax.lax.scan(self.tick, init, jnp.arange(len(self.table.ticks)))
        return loss_sum / M, stats_sum, grads

    def tick(self, carry, t):
        stash, grads, loss_sum, stats_sum = carry
        s, K = self.s, self.K
        b, m, c = self.branch[t, s], self.micro[t, s], self.chunk[t, s]
        local_chunk = c // self.table.stages
        slot = (m % K, local_chunk)
        tokens, rows = self.rows_for(m)
        ids = jax.lax.dynamic_slice_in_dim(self.layer_ids, local_chunk * self.layers_per_chunk, self.layers_per_chunk)
        inputs = _TickInputs(
            p=chunk_params(self.weights_for(m), self.is_stacked, local_chunk, self.layers_per_chunk), tokens=tokens,
            rows=rows, ids=ids, local_chunk=local_chunk, stash=stash, slot=slot, grads=grads, loss_sum=loss_sum,
            stats_sum=stats_sum)
        branches = [lambda: self.idle(inputs), lambda: self.forward(inputs, b), lambda: self.backward(inputs, b)]
        with jax.named_scope(TICK_SCOPE):
            grads, loss_sum, stats_sum, out_f, out_b, res = jax.lax.switch(switch_index(b), branches)
        # A forward's residuals go to its slot; every other tick writes the spare slot K.
        keep_slot = (jnp.where((b >= F_FIRST) & (b <= F_LAST), m % K, K), local_chunk)
        residuals = {name: [stash_write(buf, keep_slot, r) for buf, r in zip(bufs, res[name])]
                     for name, bufs in stash.residuals.items()}
        stash = self.receive(dataclasses.replace(stash, residuals=residuals), t, out_f, out_b)
        return (stash, grads, loss_sum, stats_sum), None

    def receive(self, stash: Stash, t, out_f, out_b) -> Stash:
        """Send this tick's forward output and input cotangent on, and stash what the neighbours sent:
        what arrives is known from the table (the neighbours' actions at this tick)."""
        s, S, K, branch, micro, chunk = self.s, self.table.stages, self.K, self.branch, self.micro, self.chunk
        recv_f = jax.lax.ppermute(out_f, self.axis, self.forward_perm)
        recv_b = jax.lax.ppermute(out_b, self.axis, self.backward_perm)
        prev, nxt = (s - 1) % S, (s + 1) % S
        got_f = ((branch[t, prev] == F_FIRST) | (branch[t, prev] == F_MID)) & ((s > 0) | self.ring)
        f_slot = (micro[t, prev] % K, (chunk[t, prev] + 1) // S)
        x = stash_write(stash.x, f_slot, jnp.where(got_f, recv_f, pipeline.stash_read(stash.x, f_slot)))
        got_b = ((branch[t, nxt] == B_MID) | (branch[t, nxt] == B_LAST)) & ((s < S - 1) | self.ring)
        b_slot = (micro[t, nxt] % K, (chunk[t, nxt] - 1) // S)
        g = stash_write(stash.g, b_slot, jnp.where(got_b, recv_b, pipeline.stash_read(stash.g, b_slot)))
        return dataclasses.replace(stash, x=x, g=g)

    def idle(self, i: _TickInputs):
        return i.grads, i.loss_sum, i.stats_sum, self.zeros_x, self.zeros_x, self.no_kept

    def forward(self, i: _TickInputs, branch):
        """A chunk's forward: its output goes to the next stage (on the last chunk, the head's loss is
        summed and zeros go on), and its residuals to the stash (with recompute, nothing beyond the
        input already stashed)."""
        y, loss, stats, res = self._chunk_forward(i, branch == F_FIRST, branch == F_LAST)
        kept = {name: res[name] for name in self.kept}
        return i.grads, i.loss_sum + loss, jax.tree.map(jnp.add, i.stats_sum, stats), y, self.zeros_x, kept

    def _chunk_forward(self, i: _TickInputs, first, last):
        """(output to send on, loss, (the layers' stats, the head's), residuals by part) of the chunk: the
        embedding gives the first chunk's input, and on the last chunk the head's loss is taken and zeros
        go on."""
        x, embed_res = pipeline.first_or_last_chunk(
            FIRST_CHUNK_SCOPE, first, lambda: self.embed.split_without_stats(i.p, i.tokens),
            lambda: (i.x_in, self.no_res["embed"]))
        (y, _), stats, layers_res = self.layers.split(i.p, x, i.ids, i.rows)
        loss, head_stats, head_res, y = pipeline.first_or_last_chunk(
            LAST_CHUNK_SCOPE, last, lambda: (*self.head.split(i.p, y, i.tokens), self.zeros_x),
            lambda: (jnp.zeros((), jnp.float32), self.no_head_stats, self.no_res["head"], y))
        return y, loss, (stats, head_stats), {"embed": embed_res, "layers": layers_res, "head": head_res}

    def backward(self, i: _TickInputs, branch):
        """A chunk's backward from its stashed residuals (with recompute, from its forward run again):
        the head's on the last chunk, the layers', the embedding's on the first chunk. Its weight
        gradients join the sums (inside the conds, so that a chunk adds nothing for parts it lacks), and
        its input's cotangent goes to the previous stage (zeros from the first chunk)."""
        first, last, local_chunk = branch == B_FIRST, branch == B_LAST, i.local_chunk
        stored = self._chunk_forward(i, first, last)[3] if self.recompute else i.stored

        def head_backward():
            head_grads, dy = self.head.pullback(stored["head"], i.p, self.zeros_x, i.tokens)(self.d_aux)
            return self._add_chunk_grads(i.grads, head_grads, local_chunk), dy

        grads, dy = pipeline.first_or_last_chunk(LAST_CHUNK_SCOPE, last, head_backward, lambda: (i.grads, i.g_in))
        layer_grads, dx = self.layers.pullback(stored["layers"], i.p, self.zeros_x, i.ids, i.rows)((dy, self.d_aux))
        grads = self._add_chunk_grads(grads, layer_grads, local_chunk)

        def embed_backward():
            embed_grads, _ = self.embed.pullback(stored["embed"], i.p, i.tokens)(dx)
            return self._add_chunk_grads(grads, embed_grads, local_chunk), self.zeros_x

        grads, dx = pipeline.first_or_last_chunk(FIRST_CHUNK_SCOPE, first, embed_backward, lambda: (grads, dx))
        return grads, i.loss_sum, i.stats_sum, self.zeros_x, dx, self.no_kept

    def _add_chunk_grads(self, grads, chunk_grads, local_chunk):
        n = self.layers_per_chunk
        return jax.tree.map(
            lambda g, cg, stacked: g if g.dtype == jax.dtypes.float0 else jax.lax.dynamic_update_slice_in_dim(
                g, jax.lax.dynamic_slice_in_dim(g, local_chunk * n, n) + cg.astype(g.dtype), local_chunk * n, 0)
            if stacked else g + cg.astype(g.dtype), grads, chunk_grads, self.is_stacked)



def one_f_one_b_value_and_grad(fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table,
                               axis: str = "stage", recompute: bool = False):
    """1F1B / interleaved / 2BW: every tick of the table, explicit per-tick backward.
    batch_M: (tokens_MbT, rows_Mb); layer_ids: this device's stacked layers' model-order indices.
    Returns this device's (share of the mean loss, (sums of the layers' stats, of the head's), grads);
    the loss and the head's stats are nonzero only on the last stage."""
    return _OneFOneB(fns, params, is_stacked, batch_M, layer_ids, table, axis, recompute).run(params)
