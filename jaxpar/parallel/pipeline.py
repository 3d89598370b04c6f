"""What the pipeline executors share (jaxpar.parallel.gpipe, jaxpar.parallel.one_f_one_b,
jaxpar.parallel.zero_bubble), which run per device inside `jax.shard_map` (manual over the
`stage` axis).

Each device holds its stages' layers (the stacked weights are sharded over `stage` on the
layers dimension). Neighbouring stages exchange activations (forward) and their cotangents
(backward) with `ppermute`; the embedding runs on the first stage and the head and loss on
the last, so a backward can start on the last stage as soon as its forward is done.

Every tick is one `lax.switch` over what the schedule table gives each device (`BRANCHES`):
idle, or a forward or backward (zero bubble: B or W) of the first, a middle or the last chunk.
The switch's branches are idle, forward, backward (and W), and in those a cond runs the
embedding's part on the first chunk and another the head's on the last, so the program holds
one copy of each of the chunk's programs, not three. So the embedding and the head run only
where the table puts them, and each kind can be costed from the compiled branches (`jaxpar
plan`'s executed FLOPs; `compiled_branches`).

- GPipe: a scan over the table's forward ticks, differentiated by autodiff, which gives the
  all-forwards-then-all-backwards order and keeps activations for all M microbatches.
- Naive model parallelism, 1F1B, interleaved 1F1B and 2BW: a scan over every tick of the table,
  with an explicit backward. By default a forward tick keeps the residuals of its `jax.vjp` (what backward
  needs; the weights themselves are not copied) in a buffer slot per in-flight microbatch, so
  memory stays bounded by the schedule, and a backward tick applies the received cotangent
  to them: no forward runs twice. With `recompute`, a forward tick keeps only the chunk's
  input and the backward tick recomputes the chunk from it (4/3 of the FLOPs, least memory).
- ZB-H1 and ZB-V (zero bubble): the same, with each backward split into a B tick (the input's
  cotangent, from the kept residuals) and a later W tick (the weight gradients, from what B
  handed it; jaxpar.parallel.split_backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel.schedules import Table

# The switch branches of a tick. GPipe's forward scan uses the first four; its transpose (by
# autodiff) takes the same index. 1F1B-type schedules use the first seven; the zero-bubble ones
# all ten, their backward branches computing the input's cotangent only (B) and the weight ones W.
BRANCHES = ("idle", "forward first", "forward middle", "forward last",
            "backward first", "backward middle", "backward last",
            "weight first", "weight middle", "weight last")
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST, W_FIRST, W_MID, W_LAST = range(len(BRANCHES))
# Name scope of the tick switch, found again in the compiled program's metadata.
TICK_SCOPE = "pipeline_tick"
# Name scopes of the conds inside a tick branch that run the embedding (or its backward) on the first
# chunk only, and the head and loss (or their backward) on the last: every executor's branches run
# one copy of the chunk for the first, middle and last chunk alike, not three.
FIRST_CHUNK_SCOPE = "pipeline_first_chunk"
LAST_CHUNK_SCOPE = "pipeline_last_chunk"


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
    head_loss(params, x_bLD, tokens_bT) -> (loss, stats)   last chunk: mean loss of the microbatch,
                                                           and what it reports beside it (means over
                                                           the microbatch, summed over the
                                                           microbatches; {} for none)
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
    return {"F": F_FIRST, "B": B_FIRST, "W": W_FIRST}[action.kind] + place


def compiled_branches(table: Table) -> list[tuple[int, dict[str, int]] | None]:
    """For each kind of BRANCHES, how the schedule's executor runs it: the index of the tick switch's
    branch (idle, forward, backward, weights: switch_index), and the branch (0: skip, 1: run) that
    each cond nested in it takes, by name scope; None for a kind the executor never runs (GPipe's
    switch has forward ticks only, the 1F1B types no W)."""
    places = ({FIRST_CHUNK_SCOPE: 1, LAST_CHUNK_SCOPE: 0}, {FIRST_CHUNK_SCOPE: 0, LAST_CHUNK_SCOPE: 0},
              {FIRST_CHUNK_SCOPE: 0, LAST_CHUNK_SCOPE: 1})
    kinds = [(0, {}), *[(1, place) for place in places]]
    for index, runs in ((2, table.schedule != "gpipe"), (3, table.split_backward)):
        kinds += [(index, place) if runs else None for place in places]
    return kinds


def switch_index(branch):
    """The tick switch's branch that runs a traced BRANCHES kind: idle 0, forward 1, backward (B) 2,
    weights (W) 3; the conds inside tell the first, middle and last chunk apart (compiled_branches)."""
    return jnp.where(branch == IDLE, 0, jnp.where(branch <= F_LAST, 1, jnp.where(branch <= B_LAST, 2, 3)))


def first_or_last_chunk(scope: str, run: bool, on_chunk: Callable, otherwise: Callable):
    """on_chunk() where `run` (a traced bool: this tick's chunk is the first, or the last), else
    otherwise(), in a cond named `scope` (FIRST_CHUNK_SCOPE or LAST_CHUNK_SCOPE) for the plan's
    costing."""
    with jax.named_scope(scope):
        return jax.lax.cond(run, lambda: _open(on_chunk()), lambda: _open(otherwise()))


def _open(tree):
    """The arrays of `tree` with their shardings over the automatic axes left to the partitioner. The
    branches of a cond must agree on their results' shardings, and where one branch runs the
    embedding (which constrains its output) the other passes on a stashed input (open)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return tree
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
        a, jax.sharding.PartitionSpec(*[jax.sharding.PartitionSpec.UNCONSTRAINED] * a.ndim)), tree)


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


def action_arrays(table: Table, ticks: int | None = None):
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


def chunk_params(params, is_stacked, local_chunk, layers_per_chunk: int):
    """The params tree with stacked leaves cut to one local chunk's layers."""
    return jax.tree.map(
        lambda p, stacked: jax.lax.dynamic_slice_in_dim(p, local_chunk * layers_per_chunk, layers_per_chunk)
        if stacked else p, params, is_stacked)


def local_layers(params, is_stacked) -> int:
    return jax.tree.leaves(jax.tree.map(lambda p, st: p.shape[0] if st else None, params, is_stacked))[0]


def microbatch(batch_M, m):
    """Microbatch m of (tokens_MbT, rows_Mb...) (rows may be None)."""
    return jax.tree.map(lambda a: a[m], batch_M)



def probe(fns: StageFns, compute, batch_M):
    """(the first microbatch's tokens and rows, a zero activation of the embedding's output): what an
    executor traces its tick functions' shapes with."""
    tokens0, rows0 = microbatch(batch_M, 0)
    x_aval = jax.eval_shape(fns.embed, compute, tokens0)
    return tokens0, rows0, jnp.zeros(x_aval.shape, x_aval.dtype)

def head_part(fns: StageFns) -> Residuals:
    """The head as the 1F1B-type executors keep its residuals: (the microbatch's loss in fp32, its stats)."""

    def head(p, y, tokens):
        loss, stats = fns.head_loss(p, y, tokens)
        return loss.astype(jnp.float32), stats

    return Residuals(head)


def stash_read(buf, slot):
    """buf[slot] for a slot of non-negative traced indices into buf's leading axes: one dynamic slice,
    without the sign checks and clamps that jnp indexing adds per index (and a stash of many
    residual buffers multiplies)."""
    starts = (*slot, *(0,) * (buf.ndim - len(slot)))
    return jax.lax.dynamic_slice(buf, starts, (1,) * len(slot) + buf.shape[len(slot):],
                                 allow_negative_indices=False).reshape(buf.shape[len(slot):])


def stash_write(buf, slot, value):
    """buf.at[slot].set(value) as one dynamic update slice (not a scatter). An index out of range is
    clamped (`.at[]` dropped such a write, or wrapped a negative one): the executors compute such
    slots only for what a neighbour did not send (its chunk before the first or past the last), and
    write there the value `stash_read` gives at the same slot, which changes nothing."""
    starts = (*slot, *(0,) * (buf.ndim - len(slot)))
    return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype).reshape((1,) * len(slot) + value.shape), starts,
                                        allow_negative_indices=False)


def zeros_like_shapes(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


class Residuals:
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

    def split_without_stats(self, params, x, *consts):
        """(output, storable residuals): `split` of a function that reports no stats."""
        out, _, kept = self.split(params, x, *consts)
        return out, kept

    def shapes(self, params, x, *consts) -> list:
        """Shapes and dtypes of the storable residuals."""
        return jax.eval_shape(lambda *a: self.split(*a)[2], params, x, *consts)

    def pullback(self, stored: list, params, x, *consts):
        _, _, _, tree, is_weight = self._trace(params, x, *consts)
        weights, stored = jax.tree.leaves(params), iter(stored)
        return tree.unflatten([next(stored) if w is None else weights[w] for w in is_weight])
