"""The pure training step `(state, batch) -> (state, metrics)` and the evaluation step.

Batches are int token arrays (B, T): inputs are [:, :-1], targets [:, 1:]; packed rows
(`data.packing`) are a PackedRows of the tokens with their documents, positions and loss mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import Config, TrainConfig
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.model.axes import layout_hooks
from jaxpar.model.protocol import is_block_model
from jaxpar.model.routing_trace import RoutingTrace
from jaxpar.model.segments import Segments
from jaxpar.parallel.context import device_order
from jaxpar.parallel.gradients import gradients
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline import StageFns
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.train.chunked_loss import chunked_token_losses
from jaxpar.train.loss_scale import all_finite, unless_skipped
from jaxpar.train.offload import Placement, offloaded_update
from jaxpar.train.optim import Optimizer
from jaxpar.train.remat import layer_scan
from jaxpar.train.state import TrainState


def _model(graphdef: nnx.GraphDef, params: nnx.State, precision: PrecisionPolicy, hooks=None) -> nnx.Module:
    """The model on `params` in the compute dtype (the layout's hooks expand sharded weights)."""
    return nnx.merge(graphdef, precision.cast_to_compute(hooks.model_weights(params) if hooks else params))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInputs:
    """What the layers take per row besides the residual stream: a routing-noise PRNG key per row
    (noisy top-k; else None), the documents of packed rows (else None), and the routing trace when
    the step traces routing token by token (verify; else None: jaxpar.model.routing_trace)."""

    noise_B: jax.Array | None = None
    segments: Segments | None = None
    routing: RoutingTrace | None = None


def _cross_entropy(logits_BLV: jax.Array, batch) -> jax.Array:
    """The mean next-token cross-entropy in fp32: over every target of a token array, over the counted
    targets of packed rows (weighted by the step: PackedRows.weighted)."""
    return _loss_stats(logits_BLV, batch)[0]


def _loss_stats(logits_BLV: jax.Array, batch) -> tuple[jax.Array, dict]:
    """(the mean cross-entropy, {'loss': it, and for a mixture each source's share: PackedRows.by_source})."""
    return _stats(optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), _targets(batch)),
                  batch)


def _targets(batch) -> jax.Array:
    """The next-token targets (B, L) of a token array or of packed rows."""
    return batch.targets_BL if isinstance(batch, PackedRows) else batch[:, 1:]


def _stats(losses_BL: jax.Array, batch) -> tuple[jax.Array, dict]:
    """_loss_stats from each target's cross-entropy: their mean (packed rows: weighted by the step)."""
    if isinstance(batch, PackedRows):
        loss = (losses_BL * batch.weights_BL).mean()
        return loss, {"loss": loss, **batch.by_source(losses_BL)}
    loss = losses_BL.mean()
    return loss, {"loss": loss}


def _head_stats(model: nnx.Module, x_BLD: jax.Array, batch, chunks: int) -> tuple[jax.Array, dict]:
    """_loss_stats of the logits of a block model's last hidden states, the logits computed `chunks`
    strided chunks of the sequence at a time (train.loss_chunks; jaxpar.train.chunked_loss)."""
    if chunks == 1:
        return _loss_stats(model.logits(x_BLD), batch)
    return _stats(chunked_token_losses(model, x_BLD, _targets(batch), chunks), batch)


def _embedded(model: nnx.Module, batch) -> jax.Array:
    """The model's embedding of a batch's inputs (a packed row's at its documents' positions)."""
    if isinstance(batch, PackedRows):
        return model.embed(batch.inputs_BL, batch.segments().positions_BL)
    return model.embed(batch[:, :-1])


def _logits(model: nnx.Module, batch) -> jax.Array:
    """A whole model's logits of a batch's inputs (packed rows: each document as if alone)."""
    if isinstance(batch, PackedRows):
        return model(batch.inputs_BL, batch.segments())
    return model(batch[:, :-1])


def _run_blocks(model: nnx.Module, x_BLD: jax.Array, scan, layer_ids, rows: RowInputs):
    """model.run_blocks with the rows' noise, and their documents only for packed rows: a model of
    your own that never trains packed rows need not take `segments` (jaxpar.model.protocol)."""
    documents = {} if rows.segments is None else {"segments": rows.segments}
    traced = {} if rows.routing is None else {"routing": rows.routing}
    return model.run_blocks(x_BLD, scan, layer_ids, rows.noise_B, **documents, **traced)


def weighted(batch):
    """A batch ready for the loss: packed rows get their targets' weights (computed on the whole batch)."""
    return batch.weighted() if isinstance(batch, PackedRows) else batch


def in_device_order(batch, layout: Layout):
    """Under balanced context parallelism, the batch as packed rows whose inputs' positions, targets and
    documents come in the order the context devices hold them (jaxpar.parallel.context.device_order):
    permuted once, here, and the mean loss is the same. Else the batch as it is."""
    if layout.context == 1 or not layout.context_balance:
        return batch
    rows = batch if isinstance(batch, PackedRows) else PackedRows.of_tokens(batch)
    return rows.in_order(device_order(rows.tokens_BT.shape[1] - 1, layout.context, True))


def row_inputs(batch, noise_B: jax.Array | None, routing: RoutingTrace | None = None) -> RowInputs:
    return RowInputs(noise_B, batch.segments() if isinstance(batch, PackedRows) else None, routing)


def token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT, precision: PrecisionPolicy,
               loss_chunks: int = 1) -> jax.Array:
    """Mean next-token cross-entropy over the batch (a token array or packed rows), computed in fp32
    (a block model's logits `loss_chunks` chunks of the sequence at a time: train.loss_chunks)."""
    batch = weighted(tokens_BT)
    model = _model(graphdef, params, precision)
    if loss_chunks == 1 or not is_block_model(model):
        return _cross_entropy(_logits(model, batch), batch)
    x_BLD, _ = _run_blocks(model, _embedded(model, batch), None, None, row_inputs(batch, None))
    return _head_stats(model, x_BLD, batch, loss_chunks)[0]


def routing_terms(routing: dict, moe) -> tuple[jax.Array, dict]:
    """(the MoE auxiliary losses to add to the objective, each routing statistic summed over the
    layers) from run_blocks' per-layer statistics; (0, {}) for a dense model."""
    if not routing:
        return jnp.zeros((), jnp.float32), {}
    sums = {k: jnp.sum(v, axis=0) for k, v in routing.items()}
    terms = moe.aux_weight * sums["aux"] + moe.z_loss_weight * sums["z"]
    return (terms + sums["bias_term"] if "bias_term" in sums else terms), sums


def routing_stats(sums: dict, count: int) -> dict:
    """The reported MoE statistics: routing sums over `count` (layer, microbatch) pairs, averaged."""
    if not sums:
        return {}
    mean = {k: v / count for k, v in sums.items()}
    stats = {"moe_aux_loss": mean["aux"], "moe_z_loss": mean["z"], "moe_unrouted_fraction": mean["unrouted"],
             "moe_expert_tokens": mean["expert_tokens"], "moe_max_load": mean["max_load"]}
    if "dropped" in mean:  # routers with a capacity to overflow (not Expert Choice)
        stats["moe_dropped_fraction"] = mean["dropped"]
    # traced token by token (verify): the decisions' codes, and replayed, the flips and their margins
    stats.update({f"moe_{k}": v for k, v in mean.items() if k.startswith("routing_")})
    return stats


def objective(model: nnx.Module, tokens_BT, rows: RowInputs, t: TrainConfig, moe, scan=None):
    """(cross-entropy + MoE auxiliary losses, stats): what training minimizes, and what it reports.

    tokens_BT: a token array, or packed rows weighted by the step. rows: the routing noise and the
    packed documents per row. stats: 'loss' (the cross-entropy alone) and, for MoE models, the
    routing statistics averaged over MoE layers. A model without the block protocol
    (jaxpar.model.protocol) is called whole.
    """
    if not is_block_model(model):
        return _loss_stats(_logits(model, tokens_BT), tokens_BT)
    x_BLD, routing = _run_blocks(model, _embedded(model, tokens_BT), scan, None, rows)
    loss, stats = _head_stats(model, x_BLD, tokens_BT, t.loss_chunks)
    if not routing:
        return loss, stats
    aux, sums = routing_terms(routing, moe)
    return loss + aux, {**stats, **routing_stats(sums, jax.tree.leaves(routing)[0].shape[0])}


def stage_fns(graphdef: nnx.GraphDef, hooks, cfg: Config, precision: PrecisionPolicy, scale: jax.Array) -> StageFns:
    """The model cut into embedding, a chunk of layers and head+loss, for the pipeline executors."""
    t, moe = cfg.train, cfg.model.moe
    scan = layer_scan(t.remat, hooks, t.offloads_activations)
    model = lambda p: _model(graphdef, p, precision, hooks)  # noqa: E731

    def layers(p, x_bLD, layer_ids, rows_b: RowInputs):
        x_bLD, routing = _run_blocks(model(p), x_bLD, scan, layer_ids, rows_b)
        aux, sums = routing_terms(routing, moe)
        return (x_bLD, aux * scale), sums

    return StageFns(
        cast=precision.cast_to_compute,
        embed=lambda p, tokens_bT: _embedded(model(p), tokens_bT),
        layers=layers,
        head_loss=lambda p, x_bLD, tokens_bT: _head_stats(model(p), x_bLD, tokens_bT, t.loss_chunks)[0] * scale,
    )


def accumulated_grads(loss_fn: Callable, params, batch, microbatches: int, layout: Layout):
    """(stats, gradients) of loss_fn(params, batch) -> (objective, stats), for the batch mean,
    summed over `microbatches` slices in fp32 (layout.split_microbatches: each stays spread over
    all devices, and MoE routing groups hold the same tokens as without accumulation)."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if microbatches == 1:
        grads, stats = grad_fn(params, batch)
        return stats, grads
    micro = layout.split_microbatches(batch, microbatches)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = jax.tree.map(lambda a: a[0], micro)
    zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(loss_fn, params, first)[1])

    def add_one(carry, one):
        stats_sum, grad_sum = carry
        grads, stats = grad_fn(params, one)
        return (jax.tree.map(jnp.add, stats_sum, stats), jax.tree.map(jnp.add, grad_sum, grads)), None

    (stats_sum, grad_sum), _ = jax.lax.scan(add_one, (zero_stats, zeros), micro)
    mean = lambda tree: jax.tree.map(lambda g: g / microbatches, tree)  # noqa: E731
    return mean(stats_sum), mean(grad_sum)


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """One PRNG key per batch row (the row's index folded in): per-row randomness that does not
    depend on which device or microbatch holds the row."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))


def _gradient_fn(graphdef: nnx.GraphDef, cfg: Config, layout: Layout, pipeline: PipelinePlan,
                 precision: PrecisionPolicy):
    """grad_fn(hooks, params, (tokens_BT, rows), scale) -> (stats, grads) for `gradients`: the
    objective accumulated over train.grad_accum microbatches, or run through the pipeline's schedule."""
    t, moe = cfg.train, cfg.model.moe

    def accumulated(hooks, params, batch, scale):
        scan = layer_scan(t.remat, hooks, t.offloads_activations)

        def scaled_objective(p, micro):
            tokens_BT, rows = micro
            value, stats = objective(_model(graphdef, p, precision, hooks), tokens_BT, rows, t, moe, scan)
            return value * scale, stats

        return accumulated_grads(scaled_objective, params, batch, t.grad_accum, layout)

    def pipelined(hooks, params, batch, scale):
        micro = layout.split_microbatches(batch, pipeline.table.microbatches)
        loss, sums, grads = pipeline.value_and_grad(stage_fns(graphdef, hooks, cfg, precision, scale), params,
                                                    layout.stacked_mask(params), micro)
        units = pipeline.table.microbatches * pipeline.stacked_layers
        return {"loss": loss / scale, **routing_stats(sums, units)}, grads

    return accumulated if pipeline.table is None else pipelined


def _updated(optimizer: Optimizer, state: TrainState, grads, finite, layout: Layout, offloads: bool):
    """(new parameters, new optimizer state): the optimizer's update, from pinned host memory (layer by
    layer) and back when the state is offloaded; the old ones, bit for bit, where `finite` is False."""
    if offloads:
        placement = Placement(layout.mesh, layout.opt_specs(state.opt_state)[1])
        updates, opt_state = offloaded_update(optimizer, grads, state.opt_state, state.params, placement, finite)
    else:
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
        opt_state = unless_skipped(finite, opt_state, state.opt_state)
    return unless_skipped(finite, optax.apply_updates(state.params, updates), state.params), opt_state


def make_train_step(graphdef: nnx.GraphDef, optimizer: Optimizer, cfg: Config, layout: Layout,
                    pipeline: PipelinePlan, precision: PrecisionPolicy, trace_routing: bool = False):
    """Build the pure step for one layout and pipeline plan (a plan without a table: no pipeline).

    trace_routing (an MoE model; verify): the metrics hold `moe_routing_codes`, each token's decision in
    each MoE layer, and the step takes decisions to replay as a third argument (None: route freely),
    reporting the router's own flips and their margins (jaxpar.model.routing_trace).

    Under PipeDream-2BW (pipeline.stale_weights) gradients are taken on the weights one step old
    (state.stale_params) and applied to the current ones.
    """
    t, moe = cfg.train, cfg.model.moe
    noisy = bool(moe.experts) and moe.noise and moe.chooses_top_k
    traced_units = cfg.model.n_layers // moe.every if trace_routing and moe.experts else 0
    balances_by_bias = bool(moe.experts) and moe.balance == "bias"
    grad_fn = _gradient_fn(graphdef, cfg, layout, pipeline, precision)
    # Statistics are means over the traced batch of one microbatch; token counts scale to the step.
    traced_batches = layout.manual_batch_ways * (t.grad_accum if pipeline.table is None
                                                 else pipeline.table.microbatches)

    def train_step(state: TrainState, tokens_BT, replay_BULE: jax.Array | None = None):
        scale = state.loss_scale.scale
        grad_params = state.stale_params if pipeline.stale_weights else state.params
        step_key = jax.random.fold_in(jax.random.PRNGKey(t.seed), state.step)  # the same on every layout
        tokens_BT = weighted(in_device_order(tokens_BT, layout))
        B = jax.tree.leaves(tokens_BT)[0].shape[0]
        rows_B = row_keys(step_key, B) if noisy else None
        routing = RoutingTrace(jnp.eye(B, dtype=jnp.float32), replay_BULE, units=traced_units) if traced_units else None
        stats, grads = gradients(layout, grad_fn, grad_params, (tokens_BT, row_inputs(tokens_BT, rows_B, routing)),
                                 scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        if balances_by_bias:  # the biases move by their own rule; the optimizer sees zero gradients for them
            bias_grads, grads = grads, jax.tree_util.tree_map_with_path(
                lambda p, g: jnp.zeros_like(g) if _is_bias(p) else g, grads)
        loss_scale = state.loss_scale
        # loss scaling (fp16), or on_nonfinite=skip: a step with any non-finite gradient leaves the state
        # bit-identical
        finite = all_finite(grads) if precision.loss_scaling or t.on_nonfinite == "skip" else None
        params, opt_state = _updated(optimizer, state, grads, finite, layout, t.offloads_optimizer)
        if balances_by_bias:
            moved = jax.tree_util.tree_map_with_path(
                lambda p, w, g: w - moe.bias_rate * jnp.sign(g) if _is_bias(p) else w, params, bias_grads)
            params = unless_skipped(finite, moved, params)
        if finite is not None:
            loss_scale = (loss_scale.update(finite, precision.loss_scale_window) if precision.loss_scaling
                          else loss_scale.count_skip(finite))
        metrics = {**stats, "grad_norm": optax.tree.norm(grads), "lr": optimizer.schedule(state.step),
                   "loss_scale": state.loss_scale.scale, "skipped_steps": loss_scale.skipped_steps}
        if "moe_expert_tokens" in stats:  # per traced batch -> whole batch, and its spread across experts
            counts = stats["moe_expert_tokens"] * traced_batches
            metrics["moe_expert_tokens"] = counts
            metrics["moe_load_cv"] = jnp.std(counts) / jnp.maximum(jnp.mean(counts), 1e-9)
        # the same scaling for the traced decisions: per traced batch -> whole batch
        metrics.update({k: v * traced_batches for k, v in stats.items() if k.startswith("moe_routing_")})
        if pipeline.table is not None:
            metrics["pipeline_idle_fraction"] = jnp.asarray(pipeline.table.idle_fraction, jnp.float32)
        stale = state.params if pipeline.stale_weights else None
        return TrainState(state.step + 1, params, opt_state, loss_scale, stale), metrics

    return train_step


def _is_bias(path) -> bool:
    """A router bias of bias balancing (DeepSeek-V3): after each step it moves by bias_rate toward
    equal load, down where the load was above the mean, its gradient's sign
    (jaxpar.model.moe.bias_balance_term)."""
    return "router_bias" in jax.tree_util.keystr(path)


def make_eval_step(graphdef: nnx.GraphDef, precision: PrecisionPolicy, layout: Layout, pipeline: PipelinePlan,
                   loss_chunks: int = 1):
    """Build `(params, batch) -> loss` for validation (traced outside shard_map, layers in model order)."""

    def eval_step(params, tokens_BT):
        with layout_hooks(eval_hooks(layout)):
            return token_loss(graphdef, pipeline.to_model_order(params), in_device_order(tokens_BT, layout),
                              precision, loss_chunks)

    return eval_step
