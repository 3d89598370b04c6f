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

from jaxpar.train.precision import cast_for_compute


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes from step to step: counter, fp32 parameters, optimizer state."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens_BT: jax.Array, precision: str) -> jax.Array:
    """Mean next-token cross-entropy over the batch, computed in fp32."""
    model = nnx.merge(graphdef, cast_for_compute(params, precision))
    logits_BLV = model(tokens_BT[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, tokens_BT[:, 1:]).mean()


def accumulated_grads(loss_fn: Callable, params, tokens_BT: jax.Array, microbatches: int):
    """Loss and gradients of the batch mean, summed over `microbatches` slices in fp32.

    Microbatch i takes rows i, i+k, i+2k, ... so every data-parallel shard holds an equal
    part of every microbatch and no resharding is needed.
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


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule,
                    precision: str, grad_accum: int, in_layout: Callable = lambda f: f):
    """Build the pure step; `in_layout` wraps tracing in the parallel layout's context."""

    def loss_fn(params, tokens_BT):
        return token_loss(graphdef, params, tokens_BT, precision)

    def train_step(state: TrainState, tokens_BT: jax.Array):
        with in_layout():
            loss, grads = accumulated_grads(loss_fn, state.params, tokens_BT, grad_accum)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def make_eval_step(graphdef, precision: str, in_layout: Callable):
    """Build `(params, batch) -> loss` for validation."""

    def eval_step(params, tokens_BT):
        with in_layout():
            return token_loss(graphdef, params, tokens_BT, precision)

    return eval_step
