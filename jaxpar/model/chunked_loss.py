"""The cross-entropy of a model's last hidden states computed in chunks of the sequence
(`train.loss_chunks`), so that the B x L x V fp32 logits never exist at once.

Chunk c holds positions c, c + C, c + 2C, ... of every row (C chunks): strided, so that each
chunk is spread evenly over any sharding of the sequence (sequence parallelism splits it in
contiguous blocks; a contiguous chunk would sit on one block). The chunks run one after another
in a `lax.map`; each computes its logits with the model's own `logits` (final norm, output
projection, tied or untied, vocabulary-parallel over `tensor` as the layout shards it) and its
per-token losses. The per-token losses are put back in (B, L) order, so whatever the step does
with them (a mean, packed rows' weights, a mixture's per-source losses, loss scaling) is the same
as without chunks.

The gradient is a custom VJP, after MaxText's vocabulary tiling: forward keeps nothing of a
chunk but its losses; backward runs the chunks again, each recomputing its logits and taking its
own vector-Jacobian product, and sums the output weights' gradients over the chunks in fp32 (in
the compute dtype, C partial sums would each be rounded). Only the model's weights outside the
stacked layers are differentiated here (the embedding or head, the final norm); the layers get
no gradient from the loss but through the hidden states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model.axes import is_stacked
from jaxpar.model.cross_entropy import token_cross_entropy


def _head_weight(path, variable) -> bool:
    """The weights the logits may use: every parameter outside the stacked layers."""
    return isinstance(variable, nnx.Param) and not is_stacked(variable)


def chunked_token_losses(model: nnx.Module, x_BLD: jax.Array, targets_BL: jax.Array, chunks: int) -> jax.Array:
    """The next-token cross-entropy of every position (B, L), in fp32, from the model's last hidden
    states x_BLD, the logits computed `chunks` strided chunks of the sequence at a time."""
    B, L, D = x_BLD.shape
    graphdef, head, rest = nnx.split(model, _head_weight, ...)

    def losses_of(head, rest, x_BlD, targets_Bl):
        logits_BlV = nnx.merge(graphdef, head, rest).logits(x_BlD)
        return token_cross_entropy(logits_BlV, targets_Bl)

    x_CBlD = jnp.moveaxis(x_BLD.reshape(B, L // chunks, chunks, D), 2, 0)
    targets_CBl = jnp.moveaxis(targets_BL.reshape(B, L // chunks, chunks), 2, 0)
    losses_CBl = _chunked(losses_of, head, rest, x_CBlD, targets_CBl)
    return jnp.moveaxis(losses_CBl, 0, 2).reshape(B, L)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(losses_of, head, rest, x_CBlD, targets_CBl):
    """losses_of(head, rest, x_BlD, targets_Bl) of every chunk, stacked (C, B, L / C)."""
    return jax.lax.map(lambda chunk: losses_of(head, rest, *chunk), (x_CBlD, targets_CBl))


def _chunked_fwd(losses_of, head, rest, x_CBlD, targets_CBl):
    return _chunked(losses_of, head, rest, x_CBlD, targets_CBl), (head, rest, x_CBlD, targets_CBl)


def _chunked_bwd(losses_of, residuals, grad_CBl):
    """Each chunk's logits again and its VJP: the hidden states' gradient chunk by chunk, the head
    weights' summed over the chunks in fp32 and returned in their own dtype."""
    head, rest, x_CBlD, targets_CBl = residuals

    def one_chunk(sums, chunk):
        x_BlD, targets_Bl, grad_Bl = chunk
        _, pullback = jax.vjp(lambda h, x: losses_of(h, rest, x, targets_Bl), head, x_BlD)
        grad_head, grad_x_BlD = pullback(grad_Bl)
        return jax.tree.map(lambda s, g: s + g.astype(jnp.float32), sums, grad_head), grad_x_BlD

    zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), head)
    sums, grad_x_CBlD = jax.lax.scan(one_chunk, zeros, (x_CBlD, targets_CBl, grad_CBl))
    return jax.tree.map(lambda s, w: s.astype(w.dtype), sums, head), None, grad_x_CBlD, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
