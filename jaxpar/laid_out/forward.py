"""The laid-out model's forward pass, outside any training step: the model on its parameters in the
compute dtype, each target's cross-entropy (so its log-probability), the mean loss, and the pieces a
block model runs in (embedding, layers, head), which the train step (jaxpar.train.step) and the
pipeline executors cut the model into.

Every batch is a PackedRows (jaxpar.data.packed_rows): the tokens (B, T), inputs [:, :-1] and targets
[:, 1:], with their documents, positions and loss mask when packed; a plain (B, T) token array is read
as windows of one document each.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.model.adapters import read_as
from jaxpar.model.axes import layout_hooks
from jaxpar.model.chunked_loss import chunked_token_losses
from jaxpar.model.cross_entropy import token_cross_entropy
from jaxpar.model.protocol import is_block_model
from jaxpar.model.routing_trace import RoutingTrace
from jaxpar.model.segments import Segments
from jaxpar.parallel.context import device_order
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout

if TYPE_CHECKING:  # annotations only: the chain of module-level imports stays short
    from jaxpar.parallel.pipeline_plan import PipelinePlan


def compute_model(graphdef: nnx.GraphDef, params: nnx.State, precision: PrecisionPolicy, hooks=None) -> nnx.Module:
    """The model on `params` in the compute dtype (the layout's hooks expand sharded weights)."""
    weights = precision.cast_to_compute(hooks.model_weights(params) if hooks else params)
    return nnx.merge(graphdef, read_as(weights, precision.compute))  # frozen weights read in it too


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInputs:
    """What the layers take per row besides the residual stream: a routing-noise PRNG key per row
    (noisy top-k; else None), the documents of packed rows (else None), and the routing trace when
    the step traces routing token by token (verify; else None: jaxpar.model.routing_trace)."""

    noise_B: jax.Array | None = None
    segments: Segments | None = None
    routing: RoutingTrace | None = None


def mean_loss(losses_BL: jax.Array, batch: PackedRows) -> tuple[jax.Array, dict]:
    """(the mean cross-entropy, {'loss': it, and for a mixture each source's share: PackedRows.by_source})."""
    return batch.mean_loss(losses_BL)


def logits_losses(logits_BLV: jax.Array, batch: PackedRows) -> jax.Array:
    """Each target's next-token cross-entropy (B, L), in fp32."""
    return token_cross_entropy(logits_BLV, batch.targets_BL)


def head_losses(model: nnx.Module, x_BLD: jax.Array, batch, chunks: int) -> jax.Array:
    """Each target's cross-entropy from a block model's last hidden states, the logits computed `chunks`
    strided chunks of the sequence at a time (train.loss_chunks; jaxpar.model.chunked_loss)."""
    if chunks == 1:
        return logits_losses(model.logits(x_BLD), batch)
    return chunked_token_losses(model, x_BLD, batch.targets_BL, chunks)


def embedded(model: nnx.Module, batch: PackedRows) -> jax.Array:
    """The model's embedding of a batch's inputs (a packed row's at its documents' positions)."""
    return model.embed(batch.inputs_BL, *batch.input_positions())


def whole_logits(model: nnx.Module, batch: PackedRows) -> jax.Array:
    """A whole model's logits of a batch's inputs (packed rows: each document as if alone)."""
    return model(batch.inputs_BL, *batch.documents())


def run_blocks(model: nnx.Module, x_BLD: jax.Array, scan, layer_ids, rows: RowInputs):
    """model.run_blocks with the rows' noise, and their documents only for packed rows: a model of
    your own that never trains packed rows need not take `segments` (jaxpar.model.protocol)."""
    documents = {} if rows.segments is None else {"segments": rows.segments}
    traced = {} if rows.routing is None else {"routing": rows.routing}
    return model.run_blocks(x_BLD, scan, layer_ids, rows.noise_B, **documents, **traced)


def in_device_order(batch: PackedRows, layout: Layout) -> PackedRows:
    """Under balanced context parallelism, the rows with their inputs' positions, targets and
    documents in the order the context devices hold them (jaxpar.parallel.context.device_order):
    permuted once, here, and the mean loss is the same. Else the batch as it is."""
    if layout.context == 1 or not layout.balanced_context:
        return batch
    rows = batch.with_documents()
    return rows.in_order(device_order(rows.tokens_BT.shape[1] - 1, layout.context, True))


def target_losses(graphdef: nnx.GraphDef, params: nnx.State, batch: PackedRows, precision: PrecisionPolicy,
                  loss_chunks: int = 1) -> jax.Array:
    """Each target's next-token cross-entropy (B, L) in fp32, in the targets' order (a block model's
    logits `loss_chunks` chunks of the sequence at a time: train.loss_chunks)."""
    model = compute_model(graphdef, params, precision)
    if loss_chunks == 1 or not is_block_model(model):
        return logits_losses(whole_logits(model, batch), batch)
    x_BLD, _ = run_blocks(model, embedded(model, batch), None, None, RowInputs(None, batch.segments()))
    return head_losses(model, x_BLD, batch, loss_chunks)


def token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT, precision: PrecisionPolicy,
               loss_chunks: int = 1) -> jax.Array:
    """Mean next-token cross-entropy over the batch (a token array or packed rows), computed in fp32
    (a block model's logits `loss_chunks` chunks of the sequence at a time: train.loss_chunks)."""
    batch = PackedRows.of(tokens_BT).weighted()
    return mean_loss(target_losses(graphdef, params, batch, precision, loss_chunks), batch)[0]


def make_eval_step(graphdef: nnx.GraphDef, precision: PrecisionPolicy, layout: Layout, pipeline: PipelinePlan,
                   loss_chunks: int = 1):
    """Build `(params, batch) -> loss` for validation (traced outside shard_map, layers in model order)."""

    def eval_step(params, tokens_BT):
        with layout_hooks(eval_hooks(layout)):
            return token_loss(graphdef, pipeline.to_model_order(params),
                              in_device_order(PackedRows.of(tokens_BT), layout), precision, loss_chunks)

    return eval_step
