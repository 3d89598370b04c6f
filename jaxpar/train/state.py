"""The training state: what changes from step to step, as one pytree."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from jaxpar.train.loss_scale import LossScale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes from step to step: counter, fp32 parameters, optimizer and loss-scale state."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    loss_scale: LossScale
    stale_params: nnx.State | None = None  # PipeDream-2BW: the weights one step old (None otherwise)
    outer: object = None  # local SGD with parallel.outer=nesterov: its OuterState (None otherwise)
