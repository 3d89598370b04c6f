"""The pure training step `(state, batch) -> (state, metrics)` and the evaluation step.

Batches are int token arrays (B, L+1): inputs are [:, :-1], targets [:, 1:].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.config import TrainConfig
from jaxpar.model import layout_hooks, model_weights
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


def stage_fns(graphdef: nnx.GraphDef, precision: str, remat: str, scale: jax.Array) -> StageFns:
    """The model cut into embedding, a chunk of layers and head+loss, for the pipeline executors."""
    return StageFns(
        embed=lambda p, tokens_bT: _model(graphdef, p, precision).embed(tokens_bT[:, :-1]),
        layers=lambda p, x_bLD: _model(graphdef, p, precision).run_blocks(x_bLD, remat),
        head_loss=lambda p, x_bLD, tokens_bT: _cross_entropy(_model(graphdef, p, precision).logits(x_bLD),
                                                             tokens_bT) * scale,
    )


def pipelined_grads(graphdef, t: TrainConfig, table: Table, layout):
    """grad_fn for Layout.gradients: the local batch cut into microbatches, run through the table."""
    executor = gpipe_value_and_grad if table.schedule == "gpipe" else one_f_one_b_value_and_grad

    def grad_fn(params, tokens_BT, scale):
        B, T = tokens_BT.shape
        M = table.microbatches
        tokens_MbT = tokens_BT.reshape(B // M, M, T).swapaxes(0, 1)
        return executor(stage_fns(graphdef, t.precision, t.remat, scale), params, layout.stacked_mask(params),
                        tokens_MbT, table)

    return grad_fn


def accumulated_grads(loss_fn: Callable, params, tokens_BT: jax.Array, microbatches: int):
    """Loss and gradients of the batch mean, summed over `microbatches` slices in fp32.

    Microbatch i takes rows i, i+k, i+2k, ... of the (local) batch.
    """
    grad_fn = jax.value_and_grad(loss_fn)
    if microbatches == 1:
        return grad_fn(params, tokens_BT)
    B, T = tokens_BT.shape
    micro_KBT = tokens_BT.reshape(B // microbatches, microbatches, T).swapaxes(0, 1)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def add_one(carry, tokens_bT):
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, tokens_bT)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    (loss_sum, grad_sum), _ = jax.lax.scan(add_one, (jnp.zeros((), jnp.float32), zeros), micro_KBT)
    return loss_sum / microbatches, jax.tree.map(lambda g: g / microbatches, grad_sum)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, t: TrainConfig,
                    layout, param_specs, pipeline: Table | None = None, stale_weights: bool = False):
    """Build the pure step for one layout (a jaxpar.parallel.Layout), pipelined when a table is given.

    stale_weights (PipeDream-2BW): gradients are taken on the weights one step old
    (state.stale_params) and applied to the current ones.
    """

    def accumulated(params, tokens_BT, scale):
        def scaled_loss(p, tokens):
            return token_loss(graphdef, p, tokens, t.precision, t.remat) * scale

        return accumulated_grads(scaled_loss, params, tokens_BT, t.grad_accum)

    local_grads = accumulated if pipeline is None else pipelined_grads(graphdef, t, pipeline, layout)

    def train_step(state: TrainState, tokens_BT: jax.Array):
        scale = state.loss_scale.scale
        # 2BW: gradients on the weights one step old, applied to the current weights.
        grad_params = state.stale_params if stale_weights else state.params
        loss, grads = layout.gradients(local_grads, grad_params, param_specs, tokens_BT, scale)
        loss, grads = loss / scale, jax.tree.map(lambda g: g / scale, grads)
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
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step),
                   "loss_scale": state.loss_scale.scale, "skipped_steps": loss_scale.skipped_steps}
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
