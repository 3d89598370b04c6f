"""GPipe: the table's forward ticks in a scan, the backward by autodiff (all forwards, then all
backwards; activations kept for all M microbatches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.parallel.pipeline import (
    F_FIRST,
    F_LAST,
    FIRST_CHUNK_SCOPE,
    TICK_SCOPE,
    StageFns,
    action_arrays,
    first_or_last_chunk,
    microbatch,
    stash_write,
    switch_index,
    switch_ticks,
    zeros_like_shapes,
)
from jaxpar.parallel.schedules import Table


def gpipe_value_and_grad(fns: StageFns, params, is_stacked, batch_M, layer_ids, table: Table, axis: str = "stage"):
    """GPipe: forward ticks from the table, backward by autodiff. batch_M: (tokens_MbT, rows_Mb), each a
    pytree with the microbatches on its leading axis;
    layer_ids: this device's stacked layers' model-order indices. Returns this device's
    (share of the mean loss, (sums of the layers' stats, of the head's), grads); the shares of all
    stages sum to the mean loss.

    All forwards finish before any backward, so the head and loss need not wait on the last
    stage: after the forward ticks the last chunk's outputs reach every stage (one psum of
    activations) and each stage runs the head for microbatches s, s+S, ... The head (with a
    large vocabulary, the costliest matmuls of the model) is spread over the stages instead
    of doubling the last stage's work."""
    S, M = table.stages, table.microbatches
    tokens_MbT, _ = batch_M
    forward_ticks = switch_ticks(table)
    branch, micro, _ = action_arrays(table, forward_ticks)
    s = jax.lax.axis_index(axis)
    x_shape = jax.eval_shape(fns.embed, params, microbatch(tokens_MbT, 0))
    stats_shape = jax.eval_shape(lambda p, x, b: fns.layers(p, x, layer_ids, b[1])[1], params, x_shape,
                                 microbatch(batch_M, 0))

    def local_loss(params):
        params = fns.cast(params)
        zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
        no_stats = zeros_like_shapes(stats_shape)

        def tick(carry, t):
            x_recv, outputs, aux_sum, stats_sum = carry
            m, b = micro[t, s], branch[t, s]
            tokens, rows = microbatch(batch_M, m)

            def forward():  # the embedding gives the first chunk's input; the others receive theirs
                x = first_or_last_chunk(FIRST_CHUNK_SCOPE, b == F_FIRST, lambda: fns.embed(params, tokens),
                                        lambda: x_recv)
                (y, aux), stats = fns.layers(params, x, layer_ids, rows)
                return y, aux.astype(jnp.float32), stats

            branches = [lambda: (zeros_x, jnp.zeros((), jnp.float32), no_stats), forward]
            with jax.named_scope(TICK_SCOPE):
                y, aux, stats = jax.lax.switch(switch_index(b), branches)
            # the last chunk's outputs are kept; every other tick writes the spare slot M
            outputs = stash_write(outputs, (jnp.where(b == F_LAST, m, M),), y)
            x_next = jax.lax.ppermute(y, axis, [(i, i + 1) for i in range(S - 1)])
            return (x_next, outputs, aux_sum + aux, jax.tree.map(jnp.add, stats_sum, stats)), None

        outputs = jnp.zeros((M + 1,) + x_shape.shape, x_shape.dtype)
        init = (zeros_x, outputs, jnp.zeros((), jnp.float32), no_stats)
        (_, outputs, aux_sum, stats_sum), _ = jax.lax.scan(tick, init, jnp.arange(forward_ticks))
        loss_sum, head_sums = _spread_head_losses(fns, params, outputs, tokens_MbT, table, s, axis)
        return (loss_sum + aux_sum) / M, (loss_sum / M, (stats_sum, head_sums))

    (_, (loss, stats)), grads = jax.value_and_grad(local_loss, has_aux=True, allow_int=True)(params)
    return loss, stats, grads


def _spread_head_losses(fns: StageFns, params, outputs, tokens_MbT, table: Table, s, axis: str):
    """(The sum of the losses of microbatches s, s+S, ... on stage s, the sums of their stats), once the
    last chunk's outputs (kept on the last stage) have reached every stage."""
    S, M = table.stages, table.microbatches
    # (summed in fp32: in bf16, with the batch axes manual, XLA:CPU aborted on this psum with
    # "Invalid binary instruction opcode copy")
    last = jnp.where(s == S - 1, outputs[:M], jnp.zeros_like(outputs[:M])).astype(jnp.float32)
    outputs = jax.lax.psum(last, axis).astype(outputs.dtype)
    loss_sum, stats_sum = jnp.zeros((), jnp.float32), None
    for j in range(-(-M // S)):
        m = j * S + s
        mine = jnp.minimum(m, M - 1)
        loss, stats = fns.head_loss(params, outputs[mine], microbatch(tokens_MbT, mine))
        loss_sum += jnp.where(m < M, loss.astype(jnp.float32), 0.0)
        stats = jax.tree.map(lambda x, m=m: jnp.where(m < M, x, 0.0), stats)
        stats_sum = stats if stats_sum is None else jax.tree.map(jnp.add, stats_sum, stats)
    return loss_sum, stats_sum
