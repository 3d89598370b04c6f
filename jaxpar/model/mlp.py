"""The feed-forward block; its hidden dimension is the unit of tensor parallelism."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.axes import constrain, param


class MLP(nnx.Module):
    """GeLU MLP: up-projection split by columns, down-projection by rows (Megatron)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.w_up = param(rngs.params(), (D, F), ("embed", "mlp"), D ** -0.5)
        self.w_down = param(rngs.params(), (F, D), ("mlp", "embed"), F ** -0.5 / math.sqrt(2 * cfg.n_layers))

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        h_BLF = constrain(jax.nn.gelu(jnp.einsum("BLD,DF->BLF", x_BLD, self.w_up[...])), ("batch", "seq", "mlp"))
        return constrain(jnp.einsum("BLF,FD->BLD", h_BLF, self.w_down[...]), ("batch", "seq", "embed"))
