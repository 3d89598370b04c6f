"""The pure training step `(state, batch) -> (state, metrics)` and the evaluation step.

Every batch is a PackedRows (jaxpar.data.packed_rows): the tokens (B, T), inputs [:, :-1] and
targets [:, 1:], with their documents, positions and loss mask when packed; a plain (B, T) token
array given to a step is read as windows of one document each. What a mixture of experts adds to
the step is jaxpar.model.moe_step's ExpertTerms. train.objective picks what each target's cross-entropy
reduces to: its mean (sft), or a preference loss over the rows' pairs (jaxpar.train.preference).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Config
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.model.adapters import read_as, trainable, with_frozen, zero_grad
from jaxpar.model.axes import layout_hooks
from jaxpar.model.cross_entropy import token_cross_entropy
from jaxpar.model.moe_step import ExpertTerms
from jaxpar.model.mtp import mtp_loss, mtp_weight
from jaxpar.model.protocol import is_block_model
from jaxpar.model.routing_trace import RoutingTrace
from jaxpar.model.segments import Segments
from jaxpar.parallel.context import device_order
from jaxpar.parallel.gradients import gradients
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline import StageFns
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.train import grpo
from jaxpar.train.chunked_loss import chunked_token_losses
from jaxpar.train.loss_scale import all_finite, unless_skipped
from jaxpar.train.offload import Placement, offloaded_update
from jaxpar.train.optim import Optimizer
from jaxpar.train.preference import batch_objective, weighted_pairs, without_adapters
from jaxpar.train.remat import layer_scan
from jaxpar.train.state import TrainState


def _model(graphdef: nnx.GraphDef, params: nnx.State, precision: PrecisionPolicy, hooks=None) -> nnx.Module:
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


def _cross_entropy(logits_BLV: jax.Array, batch: PackedRows) -> jax.Array:
    """The mean next-token cross-entropy in fp32: over every target of windows, over the counted
    targets of packed rows (weighted by the step: PackedRows.weighted)."""
    return _loss_stats(logits_BLV, batch)[0]


def _mean_loss(losses_BL: jax.Array, batch: PackedRows) -> tuple[jax.Array, dict]:
    """(the mean cross-entropy, {'loss': it, and for a mixture each source's share: PackedRows.by_source})."""
    return batch.mean_loss(losses_BL)


def _reduction(cfg: Config) -> Callable:
    """reduce(losses_BL, batch) -> (loss, stats): what each target's cross-entropy becomes under
    train.objective: the mean (sft), the preference loss over the rows' pairs, or GRPO's clipped policy
    objective over the rows' completions (jaxpar.train.grpo), with their metrics."""
    t = cfg.train
    if t.objective == "sft":
        return _mean_loss
    if t.objective == "grpo":
        return functools.partial(grpo.batch_objective, cfg.rl)
    return functools.partial(batch_objective, t.objective, t.preference)


def _target_losses(logits_BLV: jax.Array, batch: PackedRows) -> jax.Array:
    """Each target's next-token cross-entropy (B, L), in fp32."""
    return token_cross_entropy(logits_BLV, batch.targets_BL)


def _loss_stats(logits_BLV: jax.Array, batch: PackedRows, reduce: Callable = _mean_loss) -> tuple[jax.Array, dict]:
    """reduce (_mean_loss: the mean cross-entropy; _reduction) of the logits' per-target cross-entropy."""
    return reduce(_target_losses(logits_BLV, batch), batch)


def _head_losses(model: nnx.Module, x_BLD: jax.Array, batch, chunks: int) -> jax.Array:
    """Each target's cross-entropy from a block model's last hidden states, the logits computed `chunks`
    strided chunks of the sequence at a time (train.loss_chunks; jaxpar.train.chunked_loss)."""
    if chunks == 1:
        return _target_losses(model.logits(x_BLD), batch)
    return chunked_token_losses(model, x_BLD, batch.targets_BL, chunks)


def _head_stats(model: nnx.Module, x_BLD: jax.Array, batch, chunks: int,
                reduce: Callable = _mean_loss) -> tuple[jax.Array, dict]:
    """reduce of _head_losses: the mean cross-entropy by default; with multi-token prediction
    (jaxpar.model.mtp) its weighted loss added, and reported as mtp_loss."""
    loss, stats = reduce(_head_losses(model, x_BLD, batch, chunks), batch)
    if not getattr(model, "mtp", None):
        return loss, stats
    extra = mtp_loss(model, x_BLD, batch.tokens_BT)
    return loss + model.mtp_weight * extra, {**stats, "mtp_loss": extra}


def _embedded(model: nnx.Module, batch: PackedRows) -> jax.Array:
    """The model's embedding of a batch's inputs (a packed row's at its documents' positions)."""
    return model.embed(batch.inputs_BL, *batch.input_positions())


def _logits(model: nnx.Module, batch: PackedRows) -> jax.Array:
    """A whole model's logits of a batch's inputs (packed rows: each document as if alone)."""
    return model(batch.inputs_BL, *batch.documents())


def _run_blocks(model: nnx.Module, x_BLD: jax.Array, scan, layer_ids, rows: RowInputs):
    """model.run_blocks with the rows' noise, and their documents only for packed rows: a model of
    your own that never trains packed rows need not take `segments` (jaxpar.model.protocol)."""
    documents = {} if rows.segments is None else {"segments": rows.segments}
    traced = {} if rows.routing is None else {"routing": rows.routing}
    return model.run_blocks(x_BLD, scan, layer_ids, rows.noise_B, **documents, **traced)


def in_device_order(batch: PackedRows, layout: Layout) -> PackedRows:
    """Under balanced context parallelism, the rows with their inputs' positions, targets and
    documents in the order the context devices hold them (jaxpar.parallel.context.device_order):
    permuted once, here, and the mean loss is the same. Else the batch as it is."""
    if layout.context == 1 or not layout.context_balance:
        return batch
    rows = batch.with_documents()
    return rows.in_order(device_order(rows.tokens_BT.shape[1] - 1, layout.context, True))


def target_losses(graphdef: nnx.GraphDef, params: nnx.State, batch: PackedRows, precision: PrecisionPolicy,
                  loss_chunks: int = 1) -> jax.Array:
    """Each target's next-token cross-entropy (B, L) in fp32, in the targets' order (a block model's
    logits `loss_chunks` chunks of the sequence at a time: train.loss_chunks)."""
    model = _model(graphdef, params, precision)
    if loss_chunks == 1 or not is_block_model(model):
        return _target_losses(_logits(model, batch), batch)
    x_BLD, _ = _run_blocks(model, _embedded(model, batch), None, None, RowInputs(None, batch.segments()))
    return _head_losses(model, x_BLD, batch, loss_chunks)


def token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT, precision: PrecisionPolicy,
               loss_chunks: int = 1) -> jax.Array:
    """Mean next-token cross-entropy over the batch (a token array or packed rows), computed in fp32
    (a block model's logits `loss_chunks` chunks of the sequence at a time: train.loss_chunks)."""
    batch = PackedRows.of(tokens_BT).weighted()
    return _mean_loss(target_losses(graphdef, params, batch, precision, loss_chunks), batch)[0]


def objective(model: nnx.Module, batch: PackedRows, rows: RowInputs, cfg: Config, experts: ExpertTerms,
              scan=None):
    """(cross-entropy or preference loss + MoE auxiliary losses, stats): what training minimizes, and
    what it reports.

    batch: rows weighted by the step. rows: the routing noise and the packed documents per row.
    stats: 'loss' (the cross-entropy or preference loss alone; a preference objective adds its pair
    metrics) and, for MoE models, the routing statistics averaged over MoE layers. A model without the
    block protocol (jaxpar.model.protocol) is called whole.
    """
    if not is_block_model(model):
        return _loss_stats(_logits(model, batch), batch, _reduction(cfg))
    x_BLD, routing = _run_blocks(model, _embedded(model, batch), scan, None, rows)
    loss, stats = _head_stats(model, x_BLD, batch, cfg.train.loss_chunks, _reduction(cfg))
    if not routing:
        return loss, stats
    aux, sums = experts.objective_terms(routing)
    return loss + aux, {**stats, **experts.routing_stats(sums, jax.tree.leaves(routing)[0].shape[0])}


def stage_fns(graphdef: nnx.GraphDef, hooks, cfg: Config, precision: PrecisionPolicy, scale: jax.Array,
              experts: ExpertTerms) -> StageFns:
    """The model cut into embedding, a chunk of layers and head+loss, for the pipeline executors."""
    t = cfg.train
    scan = layer_scan(t.remat, hooks, t.offloads_activations)
    model = lambda p: _model(graphdef, p, precision, hooks)  # noqa: E731
    reduce = _reduction(cfg)

    def layers(p, x_bLD, layer_ids, rows_b: RowInputs):
        x_bLD, routing = _run_blocks(model(p), x_bLD, scan, layer_ids, rows_b)
        aux, sums = experts.objective_terms(routing)
        return (x_bLD, aux * scale), sums

    def head_loss(p, x_bLD, tokens_bT):  # the loss alone for sft; a preference objective's metrics too
        loss, stats = _head_stats(model(p), x_bLD, tokens_bT, t.loss_chunks, reduce)
        reported = {k: v for k, v in stats.items() if k != "loss" and (t.objective != "sft" or k == "mtp_loss")}
        return loss * scale, reported

    return StageFns(
        cast=precision.cast_to_compute,
        embed=lambda p, tokens_bT: _embedded(model(p), tokens_bT),
        layers=layers,
        head_loss=head_loss,
    )


def pipelined_loss(objective: jax.Array, head: dict, cfg: Config) -> dict:
    """A pipeline's loss metrics from the objective its heads summed: `loss` the next-token cross-entropy
    as without a pipeline, the weighted multi-token prediction loss (mtp_loss) taken back out."""
    if "mtp_loss" not in head:
        return {"loss": objective, **head}
    return {"loss": objective - mtp_weight(cfg.model) * head["mtp_loss"], **head}


def accumulated_grads(loss_fn: Callable, params, batch, microbatches: int, layout: Layout):
    """(stats, gradients) of loss_fn(params, batch) -> (objective, stats), for the batch mean,
    summed over `microbatches` slices in fp32 (layout.split_microbatches: each stays spread over
    all devices, and MoE routing groups hold the same tokens as without accumulation)."""
    grad_fn = jax.grad(loss_fn, has_aux=True, allow_int=True)  # a frozen weight's gradient: zero-size float0
    if microbatches == 1:
        grads, stats = grad_fn(params, batch)
        return stats, grads
    micro = layout.split_microbatches(batch, microbatches)
    zeros = jax.tree.map(zero_grad, params)
    first = jax.tree.map(lambda a: a[0], micro)
    zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(loss_fn, params, first)[1])

    def add_one(carry, one):
        stats_sum, grad_sum = carry
        grads, stats = grad_fn(params, one)
        grad_sum = jax.tree.map(lambda s, g: s if s.dtype == jax.dtypes.float0 else s + g, grad_sum, grads)
        return (jax.tree.map(jnp.add, stats_sum, stats), grad_sum), None

    (stats_sum, grad_sum), _ = jax.lax.scan(add_one, (zero_stats, zeros), micro)
    mean = lambda tree: jax.tree.map(lambda g: g / microbatches, trainable(tree))  # noqa: E731
    return mean(stats_sum), mean(grad_sum)


def _gradient_fn(graphdef: nnx.GraphDef, cfg: Config, layout: Layout, pipeline: PipelinePlan,
                 precision: PrecisionPolicy, experts: ExpertTerms):
    """grad_fn(hooks, params, (batch, rows), scale) -> (stats, grads) for `gradients`: the objective
    accumulated over train.grad_accum microbatches, or run through the pipeline's schedule."""
    t = cfg.train

    def accumulated(hooks, params, batch, scale):
        scan = layer_scan(t.remat, hooks, t.offloads_activations)

        def scaled_objective(p, micro):
            batch, rows = micro
            value, stats = objective(_model(graphdef, p, precision, hooks), batch, rows, cfg, experts, scan)
            return value * scale, stats

        return accumulated_grads(scaled_objective, params, batch, t.grad_accum, layout)

    def pipelined(hooks, params, batch, scale):
        micro = layout.split_microbatches(batch, pipeline.table.microbatches)
        loss, (sums, head_sums), grads = pipeline.value_and_grad(
            stage_fns(graphdef, hooks, cfg, precision, scale, experts), params, layout.stacked_mask(params), micro)
        M = pipeline.table.microbatches
        head = {k: v / M for k, v in head_sums.items()}
        routing = experts.routing_stats(sums, M * pipeline.stacked_layers)
        return {**pipelined_loss(loss / scale, head, cfg), **routing}, grads

    return accumulated if pipeline.table is None else pipelined


def _preparation(graphdef: nnx.GraphDef, cfg: Config, layout: Layout, pipeline: PipelinePlan,
                 precision: PrecisionPolicy) -> Callable:
    """prepare(params, batch) -> the batch as the gradient takes it: its counted targets weighted
    (PackedRows.weighted) for sft; for a preference objective its rows weighted by their valid pairs
    (jaxpar.train.preference.weighted_pairs) and, for dpo, each target's log-probability under the
    reference (the model with every adapter's B zeroed) in reference_BL, computed before and outside
    the gradient the way evaluation computes its loss, in the targets' order."""
    t = cfg.train
    if t.objective == "sft":
        return lambda params, batch: batch.weighted()
    if t.objective == "grpo":  # the rollout carries its log-probabilities (jaxpar.rl.rollout.Scoring)
        return lambda params, batch: batch

    def prepare(params, batch: PackedRows) -> PackedRows:
        batch = weighted_pairs(batch)
        if t.objective != "dpo":
            return batch
        reference = without_adapters(pipeline.to_model_order(params))
        with layout_hooks(eval_hooks(layout)):
            losses_BL = target_losses(graphdef, reference, batch, precision, t.loss_chunks)
        return dataclasses.replace(batch, reference_BL=jax.lax.stop_gradient(-losses_BL))

    return prepare


def _updated(optimizer: Optimizer, state: TrainState, grads, finite, layout: Layout, offloads: bool):
    """(new parameters, new optimizer state): the optimizer's update, from pinned host memory (layer by
    layer) and back when the state is offloaded; the old ones, bit for bit, where `finite` is False."""
    if offloads:
        placement = Placement(layout.mesh, layout.opt_specs(state.opt_state)[1])
        updates, opt_state = offloaded_update(optimizer, grads, state.opt_state, state.params, placement, finite)
    else:
        params = trainable(state.params)  # the frozen weights have no optimizer state and no update
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, params)
        opt_state = unless_skipped(finite, opt_state, state.opt_state)
        updated = unless_skipped(finite, optax.apply_updates(params, updates), params)
        return with_frozen(state.params, updated), opt_state
    return unless_skipped(finite, optax.apply_updates(state.params, updates), state.params), opt_state


def make_train_step(graphdef: nnx.GraphDef, optimizer: Optimizer, cfg: Config, layout: Layout,
                    pipeline: PipelinePlan, precision: PrecisionPolicy, trace_routing: bool = False,
                    trace_gradients: bool = False):
    """Build the pure step for one layout and pipeline plan (a plan without a table: no pipeline):
    gradients, unscaled; the update (kept back whole where a gradient is not finite and that is
    checked); the metrics. trace_routing: see jaxpar.model.moe_step. trace_gradients: the metrics also
    hold the gradients the optimizer took (`gradients`, in the layout's layer order), for verify. Under
    PipeDream-2BW gradients are taken on the weights one step old (state.stale_params) and applied to the
    current ones."""
    t = cfg.train
    experts = ExpertTerms.build(cfg.model.moe, t.seed, cfg.model.n_layers,
                                layout.manual_batch_ways * pipeline.microbatches(t.grad_accum), trace_routing,
                                keyed_rows=cfg.model.lora.dropout > 0,
                                moe_per_unit=cfg.model.moe_blocks_per_unit)
    grad_fn = _gradient_fn(graphdef, cfg, layout, pipeline, precision, experts)
    prepare = _preparation(graphdef, cfg, layout, pipeline, precision)
    checks_finite = precision.loss_scaling or t.on_nonfinite == "skip"

    def train_step(state: TrainState, batch, replay_BULE: jax.Array | None = None):
        batch, scale = prepare(state.params, in_device_order(PackedRows.of(batch), layout)), state.loss_scale.scale
        noise_B, routing = experts.row_inputs(state.step, batch.tokens_BT.shape[0], replay_BULE)
        grad_params = state.stale_params if pipeline.stale_weights else state.params
        stats, grads = gradients(layout, grad_fn, grad_params, (batch, RowInputs(noise_B, batch.segments(), routing)),
                                 scale)
        grads, held = experts.hold_bias(jax.tree.map(lambda g: g / scale, grads))
        finite = all_finite(grads) if checks_finite else None
        params, opt_state = _updated(optimizer, state, grads, finite, layout, t.offloads_optimizer)
        params = params if held is None else unless_skipped(finite, experts.move_bias(params, held), params)
        loss_scale = state.loss_scale.after_step(finite, precision)
        metrics = {**stats, "grad_norm": optax.tree.norm(grads), "lr": optimizer.schedule(state.step),
                   "loss_scale": scale, "skipped_steps": loss_scale.skipped_steps, **experts.step_metrics(stats),
                   **pipeline.step_metrics(), **({"gradients": grads} if trace_gradients else {})}
        stale = state.params if pipeline.stale_weights else None
        return TrainState(state.step + 1, params, opt_state, loss_scale, stale), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, precision: PrecisionPolicy, layout: Layout, pipeline: PipelinePlan,
                   loss_chunks: int = 1):
    """Build `(params, batch) -> loss` for validation (traced outside shard_map, layers in model order)."""

    def eval_step(params, tokens_BT):
        with layout_hooks(eval_hooks(layout)):
            return token_loss(graphdef, pipeline.to_model_order(params),
                              in_device_order(PackedRows.of(tokens_BT), layout), precision, loss_chunks)

    return eval_step
