"""The pure training step `(state, batch) -> (state, metrics)` and the evaluation step.

Batches are int token arrays (B, L+1): inputs are [:, :-1], targets [:, 1:].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import TrainConfig
from jaxpar.model import constrain, layout_hooks, model_weights
from jaxpar.parallel.pipeline import StageFns, gpipe_value_and_grad, one_f_one_b_value_and_grad
from jaxpar.parallel.schedules import Table
from jaxpar.train.precision import LossScale, all_finite, cast_for_compute


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes from step to step: counter, fp32 parameters, optimizer and loss-scale state."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    loss_scale: LossScale
    stale_params: nnx.State | None = None  # PipeDream-2BW: the weights one step old (None otherwise)


def _model(graphdef: nnx.GraphDef, params: nnx.State, precision: str):
    return nnx.merge(graphdef, cast_for_compute(model_weights(params), precision))


def _cross_entropy(logits_BLV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), tokens_BT[:, 1:]).mean()


def token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT: jax.Array, precision: str,
               remat: str = "none") -> jax.Array:
    """Mean next-token cross-entropy over the batch, computed in fp32."""
    return _cross_entropy(_model(graphdef, params, precision)(tokens_BT[:, :-1], remat=remat), tokens_BT)


def objective(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT: jax.Array, t: TrainConfig, moe,
              noise_key: jax.Array | None):
    """(cross-entropy + MoE auxiliary losses, stats): what training minimizes, and what it reports.

    stats: 'loss' (the cross-entropy alone) and, for MoE models, the routing statistics
    averaged over MoE layers.
    """
    model = _model(graphdef, params, t.precision)
    x_BLD, routing = model.run_blocks(model.embed(tokens_BT[:, :-1]), t.remat, noise_key)
    loss = _cross_entropy(model.logits(x_BLD), tokens_BT)
    if not routing:
        return loss, {"loss": loss}
    layers_mean = {k: jnp.mean(v, axis=0) for k, v in routing.items()}
    aux = moe.aux_loss_weight * jnp.sum(routing["aux"]) + moe.z_loss_weight * jnp.sum(routing["z"])
    stats = {"loss": loss, "moe_aux_loss": layers_mean["aux"], "moe_z_loss": layers_mean["z"],
             "moe_unrouted_fraction": layers_mean["unrouted"], "moe_expert_tokens": layers_mean["expert_tokens"]}
    if "dropped" in layers_mean:  # routers with a capacity to overflow (not Expert Choice)
        stats["moe_dropped_fraction"] = layers_mean["dropped"]
    return loss + aux, stats


def stage_fns(graphdef: nnx.GraphDef, precision: str, remat: str, scale: jax.Array) -> StageFns:
    """The model cut into embedding, a chunk of layers and head+loss, for the pipeline executors."""
    return StageFns(
        cast=lambda p: cast_for_compute(p, precision),
        embed=lambda p, tokens_bT: _model(graphdef, p, precision).embed(tokens_bT[:, :-1]),
        layers=lambda p, x_bLD: _model(graphdef, p, precision).run_blocks(x_bLD, remat)[0],
        head_loss=lambda p, x_bLD, tokens_bT: _cross_entropy(_model(graphdef, p, precision).logits(x_bLD),
                                                             tokens_bT) * scale,
    )


def pipelined_grads(graphdef, t: TrainConfig, table: Table, layout, recompute: bool = False):
    """grad_fn for Layout.gradients: the local batch cut into microbatches, run through the table.
    recompute: 1F1B-type schedules redo each forward in backward instead of keeping its residuals."""
    if table.schedule == "gpipe":
        executor = gpipe_value_and_grad
    else:
        executor = functools.partial(one_f_one_b_value_and_grad, recompute=recompute)

    def grad_fn(params, tokens_BT, scale, noise_key):
        B, T = tokens_BT.shape
        M = table.microbatches
        tokens_MbT = tokens_BT.reshape(B // M, M, T).swapaxes(0, 1)
        loss, grads = executor(stage_fns(graphdef, t.precision, t.remat, scale), params, layout.stacked_mask(params),
                               tokens_MbT, table)
        return {"loss": loss / scale}, grads

    return grad_fn


def accumulated_grads(loss_fn: Callable, params, tokens_BT: jax.Array, microbatches: int, shards: int = 1):
    """(stats, gradients) of loss_fn(params, tokens) -> (objective, stats), for the batch mean,
    summed over `microbatches` slices in fp32. The batch holds `shards` equal data-parallel
    shards; microbatch i takes the i-th block of consecutive rows of every shard, so each
    microbatch stays spread over all devices, and MoE routing groups (consecutive tokens) hold
    the same tokens as without accumulation.
    """
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if microbatches == 1:
        grads, stats = grad_fn(params, tokens_BT)
        return stats, grads
    B, T = tokens_BT.shape
    micro_KBT = tokens_BT.reshape(shards, microbatches, B // (shards * microbatches), T).swapaxes(0, 1)
    micro_KBT = constrain(micro_KBT.reshape(microbatches, B // microbatches, T), (None, "batch", "seq"))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero_stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(loss_fn, params, micro_KBT[0])[1])

    def add_one(carry, tokens_bT):
        stats_sum, grad_sum = carry
        grads, stats = grad_fn(params, tokens_bT)
        return (jax.tree.map(jnp.add, stats_sum, stats), jax.tree.map(jnp.add, grad_sum, grads)), None

    (stats_sum, grad_sum), _ = jax.lax.scan(add_one, (zero_stats, zeros), micro_KBT)
    mean = lambda tree: jax.tree.map(lambda g: g / microbatches, tree)  # noqa: E731
    return mean(stats_sum), mean(grad_sum)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, t: TrainConfig,
                    layout, param_specs, pipeline: Table | None = None, stale_weights: bool = False, moe=None,
                    recompute: bool = False):
    """Build the pure step for one layout (a jaxpar.parallel.Layout), pipelined when a table is given.

    recompute: 1F1B-type pipelines redo each forward in backward instead of keeping its residuals.
    stale_weights (PipeDream-2BW): gradients are taken on the weights one step old
    (state.stale_params) and applied to the current ones. moe: the model's MoEConfig (loss weights).
    """

    def accumulated(params, tokens_BT, scale, noise_key):
        def scaled_objective(p, tokens):
            value, stats = objective(graphdef, p, tokens, t, moe, noise_key)
            return value * scale, stats

        return accumulated_grads(scaled_objective, params, tokens_BT, t.grad_accum, layout.traced_batch_shards)

    local_grads = accumulated if pipeline is None else pipelined_grads(graphdef, t, pipeline, layout, recompute)

    def train_step(state: TrainState, tokens_BT: jax.Array):
        scale = state.loss_scale.scale
        # 2BW: gradients on the weights one step old, applied to the current weights.
        grad_params = state.stale_params if stale_weights else state.params
        noise_key = jax.random.fold_in(jax.random.PRNGKey(t.seed), state.step)  # same on every layout
        stats, grads = layout.gradients(local_grads, grad_params, param_specs, tokens_BT, scale, noise_key)
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        loss_scale = state.loss_scale
        if t.precision == "fp16" or t.on_nonfinite == "skip":
            # skip the update (state bit-identical) when any gradient is not finite
            finite = all_finite(grads)
            params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                             (params, opt_state), (state.params, state.opt_state))
            loss_scale = (loss_scale.update(finite, t.loss_scale_window) if t.precision == "fp16"
                          else loss_scale.count_skip(finite))
        metrics = {**stats, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step),
                   "loss_scale": state.loss_scale.scale, "skipped_steps": loss_scale.skipped_steps}
        if "moe_expert_tokens" in stats:  # per traced batch -> whole batch, and its spread across experts
            counts = stats["moe_expert_tokens"] * layout.manual_batch_ways
            metrics["moe_expert_tokens"] = counts
            metrics["moe_load_cv"] = jnp.std(counts) / jnp.maximum(jnp.mean(counts), 1e-9)
        if pipeline is not None:
            metrics["pipeline_idle_fraction"] = jnp.asarray(pipeline.idle_fraction, jnp.float32)
        stale = state.params if stale_weights else None
        return TrainState(state.step + 1, params, opt_state, loss_scale, stale), metrics

    return train_step


def make_eval_step(graphdef, precision: str, layout, to_model_order: Callable = lambda p: p):
    """Build `(params, batch) -> loss` for validation (traced outside shard_map, layers in model order)."""

    def eval_step(params, tokens_BT):
        with layout_hooks(layout.auto_hooks()):
            return token_loss(graphdef, to_model_order(params), tokens_BT, precision)

    return eval_step
