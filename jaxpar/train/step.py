"""The pure training step `(state, batch) -> (state, metrics)`: the laid-out model's forward pass
(jaxpar.laid_out.forward) turned into an objective, its gradients and the update. What a mixture of
experts adds to the step is jaxpar.model.moe_step's ExpertTerms. train.objective picks what each
target's cross-entropy reduces to: its mean (sft), a preference loss over the rows' pairs
(jaxpar.train.preference), or GRPO's policy objective (jaxpar.rl.grpo).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Config
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.laid_out.forward import (
    RowInputs,
    compute_model,
    embedded,
    head_losses,
    in_device_order,
    logits_losses,
    mean_loss,
    run_blocks,
    whole_logits,
)
from jaxpar.model.adapters import trainable, with_frozen, zero_grad
from jaxpar.model.moe_step import ExpertTerms
from jaxpar.model.mtp import mtp_loss, mtp_weight
from jaxpar.model.protocol import is_block_model
from jaxpar.parallel.gradients import gradients
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline import StageFns
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.train.loss_scale import all_finite, unless_skipped
from jaxpar.train.objectives import training_objective
from jaxpar.train.offload import Placement, offloaded_update
from jaxpar.train.optim import Optimizer
from jaxpar.train.remat import layer_scan
from jaxpar.train.state import TrainState


def _loss_stats(logits_BLV: jax.Array, batch: PackedRows, reduce: Callable = mean_loss) -> tuple[jax.Array, dict]:
    """reduce (mean_loss: the mean cross-entropy; or an objective's: jaxpar.train.objectives) of the logits'
    per-target cross-entropy."""
    return reduce(logits_losses(logits_BLV, batch), batch)


def _head_stats(model: nnx.Module, x_BLD: jax.Array, batch, chunks: int,
                reduce: Callable = mean_loss) -> tuple[jax.Array, dict]:
    """reduce of head_losses: the mean cross-entropy by default; with multi-token prediction
    (jaxpar.model.mtp) its weighted loss added, and reported as mtp_loss."""
    loss, stats = reduce(head_losses(model, x_BLD, batch, chunks), batch)
    if not getattr(model, "mtp", None):
        return loss, stats
    extra = mtp_loss(model, x_BLD, batch.tokens_BT)
    return loss + model.mtp_weight * extra, {**stats, "mtp_loss": extra}


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
        return _loss_stats(whole_logits(model, batch), batch, training_objective(cfg).reduction())
    x_BLD, routing = run_blocks(model, embedded(model, batch), scan, None, rows)
    loss, stats = _head_stats(model, x_BLD, batch, cfg.train.loss_chunks, training_objective(cfg).reduction())
    if not routing:
        return loss, stats
    aux, sums = experts.objective_terms(routing)
    return loss + aux, {**stats, **experts.routing_stats(sums, jax.tree.leaves(routing)[0].shape[0])}


def stage_fns(graphdef: nnx.GraphDef, hooks, cfg: Config, precision: PrecisionPolicy, scale: jax.Array,
              experts: ExpertTerms) -> StageFns:
    """The model cut into embedding, a chunk of layers and head+loss, for the pipeline executors."""
    t = cfg.train
    scan = layer_scan(t.remat, hooks, t.offloads_activations)
    model = lambda p: compute_model(graphdef, p, precision, hooks)  # noqa: E731
    objective = training_objective(cfg)
    reduce = objective.reduction()

    def layers(p, x_bLD, layer_ids, rows_b: RowInputs):
        x_bLD, routing = run_blocks(model(p), x_bLD, scan, layer_ids, rows_b)
        aux, sums = experts.objective_terms(routing)
        return (x_bLD, aux * scale), sums

    def head_loss(p, x_bLD, tokens_bT):
        loss, stats = _head_stats(model(p), x_bLD, tokens_bT, t.loss_chunks, reduce)
        return loss * scale, objective.head_metrics(stats)

    return StageFns(
        cast=precision.cast_to_compute,
        embed=lambda p, tokens_bT: embedded(model(p), tokens_bT),
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
            value, stats = objective(compute_model(graphdef, p, precision, hooks), batch, rows, cfg, experts, scan)
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


class UpdateTail:
    """What every step does once it has its gradients (scaled by the loss scale): unscale them, hold MoE's
    bias-balancing counts apart, check them finite where that is asked for, update the weights and the
    optimizer state (where `applies`: the finite check, and for 2BW whether a step was in flight), move the
    bias, step the loss scale, and gather the metrics. Shared by the synchronous step and 2BW's."""

    def __init__(self, optimizer: Optimizer, cfg: Config, layout: Layout, pipeline: PipelinePlan,
                 precision: PrecisionPolicy, experts: ExpertTerms, trace_gradients: bool):
        self.optimizer, self.layout, self.pipeline, self.precision = optimizer, layout, pipeline, precision
        self.experts, self.trace_gradients = experts, trace_gradients
        self.offloads = cfg.train.offloads_optimizer
        self.checks_finite = precision.loss_scaling or cfg.train.on_nonfinite == "skip"

    def __call__(self, state: TrainState, stats: dict, grads, scale: jax.Array, schedule_step: jax.Array,
                 live: jax.Array | None = None):
        """(params, opt_state, loss_scale, metrics) after the update of the step whose learning rate is the
        schedule's at `schedule_step`; `live` False: there was no gradient to apply (2BW's first step)."""
        experts, optimizer = self.experts, self.optimizer
        grads, held = experts.hold_bias(jax.tree.map(lambda g: g / scale, grads))
        finite = all_finite(grads) if self.checks_finite else None
        applies = finite if live is None else (live if finite is None else live & finite)
        params, opt_state = _updated(optimizer, state, grads, applies, self.layout, self.offloads)
        params = params if held is None else unless_skipped(applies, experts.move_bias(params, held), params)
        loss_scale = state.loss_scale.after_step(finite, self.precision)
        metrics = {**stats, "grad_norm": optax.tree.norm(grads), "lr": optimizer.schedule(schedule_step),
                   "loss_scale": scale, "skipped_steps": loss_scale.skipped_steps, **experts.step_metrics(stats),
                   **self.pipeline.step_metrics(), **({"gradients": grads} if self.trace_gradients else {})}
        return params, opt_state, loss_scale, metrics


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
    prepare = training_objective(cfg).preparation(graphdef, layout, pipeline, precision)
    update = UpdateTail(optimizer, cfg, layout, pipeline, precision, experts, trace_gradients)

    def train_step(state: TrainState, batch, replay_BULE: jax.Array | None = None):
        batch, scale = prepare(state.params, in_device_order(PackedRows.of(batch), layout)), state.loss_scale.scale
        noise_B, routing = experts.row_inputs(state.step, batch.tokens_BT.shape[0], replay_BULE)
        grad_params = state.stale_params if pipeline.stale_weights else state.params
        stats, grads = gradients(layout, grad_fn, grad_params, (batch, RowInputs(noise_B, batch.segments(), routing)),
                                 scale)
        params, opt_state, loss_scale, metrics = update(state, stats, grads, scale, state.step)
        stale = state.params if pipeline.stale_weights else None
        return TrainState(state.step + 1, params, opt_state, loss_scale, stale), metrics

    return train_step
