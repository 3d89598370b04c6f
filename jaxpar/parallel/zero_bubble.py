"""ZB-H1 and ZB-V: every tick of the table in a scan, each tick an F, B or W of one chunk (or idle)
chosen by a `lax.switch`, with the `ppermute`s of 1F1B between neighbouring stages.

F runs the chunk and keeps its `jax.vjp` residuals, as 1F1B's forward does. B computes the
chunk input's cotangent from them, with the gradients that need no matmul, and hands W what
it needs; W computes the weight gradients (jaxpar.parallel.split_backward divides the one
backward program between them, so nothing runs twice). Each kind of kept value (inputs,
cotangents, residuals that only B reads, residuals W reads, what B hands W) has its own pool of
slots, and every value its slot for its whole life, both assigned from the table
(jaxpar.parallel.stash_slots): memory follows what each schedule keeps in flight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.pipeline import (
    B_FIRST,
    B_LAST,
    F_FIRST,
    F_LAST,
    FIRST_CHUNK_SCOPE,
    LAST_CHUNK_SCOPE,
    TICK_SCOPE,
    W_LAST,
    Residuals,
    StageFns,
    action_arrays,
    chunk_params,
    first_or_last_chunk,
    head_part,
    local_layers,
    microbatch,
    probe,
    stash_read,
    stash_write,
    switch_index,
    zeros_like_shapes,
)
from jaxpar.parallel.schedules import Table
from jaxpar.parallel.split_backward import SplitBackward
from jaxpar.parallel.stash_slots import Pool, assign, write_slots

# What arrives at a device at the end of a tick, from each neighbour and from itself (zbv's turn)
_SOURCES = ("below", "above", "local")
_NOTHING, _INPUT, _COTANGENT = 0, 1, 2


class _Tick:
    """One tick's work on this device: its chunk's weights, microbatch, layer ids and local chunk,
    the pools (`kept`, read at this action's slots) and the running sums."""

    def __init__(self, ex, stash, t, carry):
        self.grads, self.loss_sum, self.stats_sum = carry
        s = ex.s
        self.branch, m, c = ex.branch[t, s], ex.micro[t, s], ex.chunk[t, s]
        self.local_chunk = c // ex.table.stages
        self.tokens, self.rows = microbatch(ex.batch_M, m)
        n = ex.per_chunk
        self.ids = jax.lax.dynamic_slice_in_dim(ex.layer_ids, self.local_chunk * n, n)
        self.p = chunk_params(ex.compute, ex.is_stacked, self.local_chunk, n)
        self.slot = {name: slots[t, s] for name, slots in ex.own_slot.items()}
        self.stash = stash

    def kept(self, pool: str) -> list:
        """The values of `pool` at this action's slot (none when the layout keeps nothing there)."""
        return [stash_read(buf, (self.slot[pool],)) for buf in self.stash.get(pool, [])]


class _ZeroBubble:
    """ZB-H1 / ZB-V on one device: every tick of the table in a `lax.scan`, each a `lax.switch` over
    idle, F, B and W (the embedding's part on the first chunk and the head's on the last in conds
    inside them). Built once per trace: the three backward programs split into B and W (layers,
    head; the embedding's whole in B), the pools with their shapes, and per tick and stage the slots
    each action reads, writes and receives."""

    def __init__(self, fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table, axis: str):
        self.fns, self.is_stacked, self.batch_M, self.layer_ids = fns, is_stacked, batch_M, layer_ids
        self.table, self.axis = table, axis
        self.s = jax.lax.axis_index(axis)
        self.per_chunk = local_layers(params, is_stacked) // table.virtual
        self.compute = fns.cast(params)  # once per step; residuals refer to these weights, never copy them
        self.branch, self.micro, self.chunk = action_arrays(table)
        tokens0, rows0, self.zeros_x = probe(fns, self.compute, batch_M)
        self.d_aux = jnp.asarray(1.0 / table.microbatches, jnp.float32)  # the objective is the mean over microbatches
        self.embed = Residuals(lambda p, tokens: (fns.embed(p, tokens), {}))
        self.layers = Residuals(lambda p, x, ids, rows: fns.layers(p, x, ids, rows))
        self.head = head_part(fns)
        chunk0 = chunk_params(self.compute, is_stacked, 0, self.per_chunk)
        ids0 = layer_ids[:self.per_chunk]
        self.no_head_stats = zeros_like_shapes(jax.eval_shape(lambda *a: self.head.split(*a)[1], self.compute,
                                                              self.zeros_x, tokens0))
        self.no_stats = (zeros_like_shapes(jax.eval_shape(lambda *a: self.layers.split(*a)[1], chunk0, self.zeros_x,
                                                          ids0, rows0)), self.no_head_stats)
        embed_kept = self.embed.shapes(self.compute, tokens0)
        layers_kept = self.layers.shapes(chunk0, self.zeros_x, ids0, rows0)
        head_kept = self.head.shapes(self.compute, self.zeros_x, tokens0)
        self.layers_split = SplitBackward(self._layers_backward, chunk0, layers_kept, ids0, rows0, self.zeros_x)
        self.head_split = SplitBackward(self._head_backward, chunk0, head_kept, tokens0)
        # the embedding's backward (a scatter-add, no matmul) runs whole in B; this drops its zeros
        self.embed_backward = SplitBackward(self._embed_backward, chunk0, embed_kept, tokens0, self.zeros_x, whole=True)
        self.n_kept = {"embed": len(embed_kept), "layers": len(layers_kept), "head": len(head_kept)}
        self.no_embed_res, self.no_head_res = zeros_like_shapes(embed_kept), zeros_like_shapes(head_kept)
        self.stacked = jax.tree.leaves(is_stacked)
        self._plan_pools(embed_kept, layers_kept, head_kept)

    # ---- the backward programs that are split ----------------------------------------------
    def _layers_backward(self, p, stored, ids, rows, dy):
        """(the chunk's weight gradients, the cotangent of its input) from its residuals and dy."""
        return self.layers.pullback(stored, p, self.zeros_x, ids, rows)((dy, self.d_aux))

    def _embed_backward(self, p, stored, tokens, dx):
        """(the embedding's weight gradients, no cotangent) from the first chunk's input cotangent."""
        return self.embed.pullback(stored, p, tokens)(dx)[0], ()

    def _head_backward(self, p, stored, tokens):
        """(the head's weight gradients, the cotangent of the last chunk's output)."""
        return self.head.pullback(stored, p, self.zeros_x, tokens)(self.d_aux)

    # ---- pools and slots ---------------------------------------------------------------------
    def _plan_pools(self, embed_kept, layers_kept, head_kept):
        """Which residual leaf goes to which pool, each pool's buffers and every action's slots."""
        n_p = len(jax.tree.leaves(self.compute))  # the stored residuals follow the weights among the inputs
        layers_at, head_at, embed_at = (range(n_p, n_p + len(k)) for k in (layers_kept, head_kept, embed_kept))
        self.reads_dy = self.layers_split.in_tree.num_leaves - 1 in self.layers_split.w_inputs
        self.leaves = {
            "layers B": _b_only(self.layers_split, layers_at), "layers W": _w_reads(self.layers_split, layers_at),
            "head B": _b_only(self.head_split, head_at), "head W": _w_reads(self.head_split, head_at),
            "embed B": _b_only(self.embed_backward, embed_at),
        }
        kept = {"layers": layers_kept, "head": head_kept, "embed": embed_kept}
        shapes = {name: [kept[name.split()[0]][j] for j in leaves] for name, leaves in self.leaves.items()}
        shapes["layers cross"] = self.layers_split.crossing_shapes
        shapes["head cross"] = self.head_split.crossing_shapes
        shapes["x"] = shapes["g"] = [self.zeros_x]
        end_g = "W" if self.reads_dy else "B"
        pools = [Pool("x", "sent F", "F", "not first"), Pool("g", "sent B", end_g, "not last"),
                 Pool("embed B", "F", "B", "first"), Pool("layers B", "F", "B"), Pool("layers W", "F", "W"),
                 Pool("layers cross", "B", "W"), Pool("head B", "F", "B", "last"), Pool("head W", "F", "W", "last"),
                 Pool("head cross", "B", "W", "last")]
        if self.reads_dy:  # W reads dy: the last chunk's comes from its own head, kept from B to W
            pools.append(Pool("g", "B", "W", "last"))
        pools = [p for p in pools if shapes[p.name]]
        slots = assign(self.table, pools)
        self.shapes = {p.name: shapes[p.name] for p in pools}
        last = self.table.stages * self.table.virtual - 1
        kept_by = {p.name: [q for q in pools if q.name == p.name and q.start in ("F", "B")] for p in pools}
        self.write_slot = {}  # pools a branch writes (not the neighbours' sends): [tick, stage] -> slot
        for name, specs in kept_by.items():
            if specs:
                writes = lambda a, specs=specs: any(q.written_by(a, last) for q in specs)  # noqa: E731
                self.write_slot[name] = jnp.asarray(write_slots(self.table, slots, name, writes))
        self.count = slots.count  # with the spare slots write_slots added
        self.own_slot = {name: jnp.asarray(a) for name, a in _own_slots(self.table, slots, self.shapes).items()}
        self.arrivals = _arrivals(self.table, slots)

    def run(self, params):
        """(this device's share of the mean loss, (sums of the layers' stats, of the head's), grads)."""
        stash = {name: [jnp.zeros((max(self.count.get(name, 0), 1),) + a.shape, a.dtype) for a in shapes]
                 for name, shapes in self.shapes.items()}
        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = (stash, grads0, jnp.zeros((), jnp.float32), self.no_stats)
        (_, grads, loss_sum, stats_sum), _ = jax.lax.scan(self.tick, init, jnp.arange(len(self.table.ticks)))
        return loss_sum / self.table.microbatches, stats_sum, grads

    def tick(self, carry, t):
        stash, *sums = carry
        i = _Tick(self, stash, t, tuple(sums))
        branches = [lambda: self.idle(i), lambda: self.forward(i), lambda: self.input_backward(i),
                    lambda: self.weight_backward(i)]
        with jax.named_scope(TICK_SCOPE):
            grads, loss_sum, stats_sum, sent, writes = jax.lax.switch(switch_index(i.branch), branches)
        stash = self._keep(stash, writes, t)
        stash = self._receive(stash, t, sent)
        return (stash, grads, loss_sum, stats_sum), None

    # ---- what a tick keeps and receives --------------------------------------------------------
    def _no_writes(self) -> dict:
        """What a branch that keeps nothing in a pool gives it: zeros, written into a free slot."""
        return {name: [jnp.zeros(a.shape, a.dtype) for a in self.shapes[name]] for name in self.write_slot}

    def _written(self, writes: dict) -> dict:
        """A branch's writes, zeros for every kept pool it leaves alone (all branches give one structure)."""
        return {**self._no_writes(), **{k: v for k, v in writes.items() if k in self.write_slot}}

    def _keep(self, stash, writes: dict, t) -> dict:
        """Each kept pool gets the tick's values at its write slot: the action's own, or a free one
        (stash_slots.write_slots): one update per pool and tick, and no select."""
        stash = dict(stash)
        for name, values in writes.items():
            slot = self.write_slot[name][t, self.s]
            stash[name] = [stash_write(buf, (slot,), v) for buf, v in zip(stash[name], values)]
        return stash

    def _receive(self, stash, t, sent) -> dict:
        """Send this tick's output (a forward's activation or B's input cotangent) to both neighbours,
        and keep what the table says arrives: an input or a cotangent, from below, above or (zbv's
        turn at the bottom of the V) this device itself."""
        S = self.table.stages
        got = {"below": jax.lax.ppermute(sent, self.axis, [(i, i + 1) for i in range(S - 1)]),
               "above": jax.lax.ppermute(sent, self.axis, [(i + 1, i) for i in range(S - 1)]), "local": sent}
        stash = dict(stash)
        for source, value in got.items():
            kinds, slots, present = self.arrivals[source]
            kind, slot = kinds[t, self.s], slots[t, self.s]
            for what, pool in ((_INPUT, "x"), (_COTANGENT, "g")):
                if what in present:
                    (buf,) = stash[pool]
                    stash[pool] = [stash_write(buf, (slot,), jnp.where(kind == what, value.astype(buf.dtype),
                                                                      stash_read(buf, (slot,))))]
        return stash

    def _stored(self, i: _Tick, part: str, halves: tuple[str, ...] = ("B", "W")) -> list:
        """A part's residuals as its pullback takes them, from its pools (None where not kept)."""
        stored = [None] * self.n_kept[part]
        for half in halves:
            name = f"{part} {half}"
            if name in self.shapes:
                for j, value in zip(self.leaves[name], i.kept(name)):
                    stored[j] = value
        return stored

    def _add(self, grads, parts: dict, local_chunk):
        """Add gradients given by leaf index (a stacked leaf's into its chunk's layers) to the sums."""
        leaves, tree = jax.tree.flatten(grads)
        n = self.per_chunk
        for g, value in parts.items():
            value = value.astype(leaves[g].dtype)
            if self.stacked[g]:
                chunk = jax.lax.dynamic_slice_in_dim(leaves[g], local_chunk * n, n)
                leaves[g] = jax.lax.dynamic_update_slice_in_dim(leaves[g], chunk + value, local_chunk * n, 0)
            else:
                leaves[g] = leaves[g] + value
        return tree.unflatten(leaves)

    # ---- the branches ------------------------------------------------------------------------
    def idle(self, i: _Tick):
        return i.grads, i.loss_sum, i.stats_sum, self.zeros_x, self._no_writes()

    def forward(self, i: _Tick):
        """F: the chunk's output goes to the next chunk (the last chunk's loss is summed), its residuals
        to the pools B and W read them from."""
        writes = {}
        x, embed_res = first_or_last_chunk(
            FIRST_CHUNK_SCOPE, i.branch == F_FIRST, lambda: self.embed.split_without_stats(i.p, i.tokens),
            lambda: (i.kept("x")[0], self.no_embed_res))
        self._fill(writes, "embed", embed_res)
        (y, _), stats, res = self.layers.split(i.p, x, i.ids, i.rows)
        self._fill(writes, "layers", res)
        loss, head_stats, head_res, y = first_or_last_chunk(
            LAST_CHUNK_SCOPE, i.branch == F_LAST, lambda: (*self.head.split(i.p, y, i.tokens), self.zeros_x),
            lambda: (jnp.zeros((), jnp.float32), self.no_head_stats, self.no_head_res, y))
        self._fill(writes, "head", head_res)
        stats_sum = jax.tree.map(jnp.add, i.stats_sum, (stats, head_stats))
        return i.grads, i.loss_sum + loss, stats_sum, y, self._written(writes)

    def _fill(self, writes: dict, part: str, residuals: list) -> None:
        for half in ("B", "W"):
            writes[f"{part} {half}"] = [residuals[j] for j in self.leaves.get(f"{part} {half}", [])]

    def input_backward(self, i: _Tick):
        """B: the chunk input's cotangent (sent to the previous chunk) and the gradients that need no
        matmul (added inside the conds, so that a chunk adds nothing for parts it lacks); what W will
        need goes to the crossing pools."""
        no_writes = self._no_writes()
        # the pools only the last chunk's B writes ("g" is one where W reads dy: _plan_pools)
        last_writes = [name for name in ("head cross", "g") if name in no_writes]

        def head_b():
            leaves = jax.tree.leaves(i.p) + self._stored(i, "head") + jax.tree.leaves(i.tokens)
            dy, in_b, cross = self.head_split.input_half(leaves)
            # W reads dy: the last chunk's, from its own head, is kept too
            kept = {"head cross": cross, "g": [dy]}
            return self._add(i.grads, in_b, i.local_chunk), dy, {name: kept[name] for name in last_writes}

        grads, dy, writes = first_or_last_chunk(
            LAST_CHUNK_SCOPE, i.branch == B_LAST, head_b,
            lambda: (i.grads, i.kept("g")[0], {name: no_writes[name] for name in last_writes}))
        leaves = jax.tree.leaves(i.p) + self._stored(i, "layers") + jax.tree.leaves((i.ids, i.rows, dy))
        dx, in_b, writes["layers cross"] = self.layers_split.input_half(leaves)
        grads = self._add(grads, in_b, i.local_chunk)

        def embed_b():
            leaves = jax.tree.leaves(i.p) + self._stored(i, "embed") + jax.tree.leaves((i.tokens, dx))
            return self._add(grads, self.embed_backward.input_half(leaves)[1], i.local_chunk), self.zeros_x

        grads, dx = first_or_last_chunk(FIRST_CHUNK_SCOPE, i.branch == B_FIRST, embed_b, lambda: (grads, dx))
        return grads, i.loss_sum, i.stats_sum, dx, self._written(writes)

    def weight_backward(self, i: _Tick):
        """W: the weight gradients, from the residuals W reads and what B handed over."""
        dy = i.kept("g")[0] if self.reads_dy else None
        leaves = jax.tree.leaves(i.p) + self._stored(i, "layers", ("W",)) + jax.tree.leaves((i.ids, i.rows)) + [dy]
        grads = self._add(i.grads, self.layers_split.weight_half(leaves, i.kept("layers cross")), i.local_chunk)

        def head_w():
            leaves = jax.tree.leaves(i.p) + self._stored(i, "head", ("W",)) + jax.tree.leaves(i.tokens)
            return self._add(grads, self.head_split.weight_half(leaves, i.kept("head cross")), i.local_chunk)

        grads = first_or_last_chunk(LAST_CHUNK_SCOPE, i.branch == W_LAST, head_w, lambda: grads)
        return grads, i.loss_sum, i.stats_sum, self.zeros_x, self._no_writes()


def _b_only(split: SplitBackward, at) -> list[int]:
    """Which kept residuals (positions `at` among the split's inputs) only B reads."""
    return [j for j, p in enumerate(at) if p in split.b_inputs and p not in split.w_inputs]


def _w_reads(split: SplitBackward, at) -> list[int]:
    return [j for j, p in enumerate(at) if p in split.w_inputs]


def _own_slots(table: Table, slots, pools) -> dict[str, np.ndarray]:
    """(ticks, stages) per pool: the slot of the value the action at each tick and stage reads or writes."""
    out = {}
    for name in pools:
        a = np.zeros((len(table.ticks), table.stages), np.int32)
        for t, row in enumerate(table.ticks):
            for s, action in enumerate(row):
                if action is not None:
                    a[t, s] = slots.of(name, s, action.microbatch, action.chunk)
        out[name] = a
    return out


def _arrivals(table: Table, slots) -> dict:
    """Per source (below, above, local): (ticks, stages) arrays of what arrives at the end of each tick
    (nothing, an input, a cotangent) and its slot, and which kinds arrive at all."""
    T, S, last = len(table.ticks), table.stages, table.stages * table.virtual - 1
    kind = {source: np.zeros((T, S), np.int32) for source in _SOURCES}
    slot = {source: np.zeros((T, S), np.int32) for source in _SOURCES}
    for t, row in enumerate(table.ticks):
        for s, a in enumerate(row):
            if a is not None and a.kind == "F" and a.chunk < last:
                k, what, pool = a.chunk + 1, _INPUT, "x"
            elif a is not None and a.kind == "B" and a.chunk > 0:
                k, what, pool = a.chunk - 1, _COTANGENT, "g"
            else:
                continue
            d = table.stage_of(k)
            source = {s: "local", s + 1: "below", s - 1: "above"}[d]
            kind[source][t, d], slot[source][t, d] = what, slots.of(pool, d, a.microbatch, k)
    return {source: (jnp.asarray(kind[source]), jnp.asarray(slot[source]), set(np.unique(kind[source])) - {0})
            for source in _SOURCES}


def zero_bubble_value_and_grad(fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table,
                               axis: str = "stage"):
    """ZB-H1 / ZB-V: every tick of the table, each an F, B or W. batch_M: (tokens_MbT, rows_Mb);
    layer_ids: this device's stacked layers' model-order indices. Returns this device's (share of the
    mean loss, (sums of the layers' stats, of the head's), grads); the loss and the head's stats are
    nonzero only where the last chunk runs."""
    return _ZeroBubble(fns, params, is_stacked, batch_M, layer_ids, table, axis).run(params)
