"""The training state: what changes from step to step, as one pytree."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from jaxpar.train.loss_scale import LossScale

# The parts of the state that only some layouts keep, as checkpoints key them: 2BW's weights one step old,
# and what a 2BW step leaves in flight. A checkpoint fits a layout with or without them.
STALE, IN_FLIGHT = "stale_params/", "in_flight/"
OPTIONAL_PARTS = (STALE, IN_FLIGHT)


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
    in_flight: InFlight | None = None  # PipeDream-2BW on stages: what one step leaves to the next (None otherwise)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InFlight:
    """What a 2BW step leaves to the next (jaxpar.parallel.two_bw): the stash of its microbatches still
    in the pipeline and its partial sums, each device's own (carry); its batch as the step prepared it,
    and the rows' routing-noise keys (or None); and whether there is any (live: False before the first
    step and after the drain)."""

    carry: object
    batch: object
    noise_B: jax.Array | None
    live: jax.Array
