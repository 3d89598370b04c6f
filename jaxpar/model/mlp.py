"""The feed-forward block; its hidden dimension is the unit of tensor parallelism."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxpar.config.model import ModelConfig
from jaxpar.model.adapters import adapters, lora_output, with_lora
from jaxpar.model.axes import column_parallel, constrain, param, row_parallel

# The gated MLPs' activations on the gate (jax.nn.gelu is the tanh approximation, gelu_pytorch_tanh).
GATED = {"swiglu": jax.nn.silu, "geglu": jax.nn.gelu}


class MLP(nnx.Module):
    """GeLU, SwiGLU or GeGLU MLP: up-projection split by columns, down-projection by rows (Megatron).

    SwiGLU (`model.mlp=swiglu`, Llama): silu(x W_gate) * (x W_up), then W_down; GeGLU (`geglu`,
    Gemma): the tanh-approximated gelu in place of silu. The gate and up weights share one fused
    weight (one matmul), each of them split by columns.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.d_ff
        self.gated = cfg.gated_mlp
        self.activation = GATED.get(cfg.mlp, jax.nn.gelu)
        if self.gated:  # slot 0: gate, slot 1: up
            self.w_gate_up = param(rngs.params(), (D, 2, F), ("embed", None, "mlp"), D ** -0.5)
        else:
            self.w_up = param(rngs.params(), (D, F), ("embed", "mlp"), D ** -0.5)
        self.w_down = param(rngs.params(), (F, D), ("mlp", "embed"), F ** -0.5 / math.sqrt(2 * cfg.n_layers))
        into, out_of = (((), (D,), (F,)), ((), ("embed",), ("mlp",))), (((), (F,), (D,)), ((), ("mlp",), ("embed",)))
        lora = adapters(cfg.lora, rngs, {"gate": into, "up": into, "down": out_of})
        self.lora_gate, self.lora_up, self.lora_down = (lora["gate"] if self.gated else None), lora["up"], lora["down"]

    def __call__(self, x_BLD: jax.Array, keys_B: jax.Array | None = None) -> jax.Array:
        """keys_B (training): a PRNG key per row, for the adapters' dropout."""
        residual, hidden = ("batch", "residual_seq", "embed"), ("batch", "seq", "mlp")
        if self.gated:
            fused = ("batch", "seq", None, "mlp")
            gate_up_BLQF = with_lora(column_parallel("BLD,DQF->BLQF", x_BLD, self.w_gate_up, residual, fused),
                                     lora_output(x_BLD, (self.lora_gate, self.lora_up), residual, fused, keys_B=keys_B))
            h_BLF = self.activation(gate_up_BLQF[:, :, 0]) * gate_up_BLQF[:, :, 1]
        else:
            h_BLF = jax.nn.gelu(with_lora(column_parallel("BLD,DF->BLF", x_BLD, self.w_up, residual, hidden),
                                          lora_output(x_BLD, self.lora_up, residual, hidden, keys_B=keys_B)))
        h_BLF = constrain(h_BLF, hidden)
        y_BLD = with_lora(row_parallel("BLF,FD->BLD", h_BLF, self.w_down, hidden, residual),
                          lora_output(h_BLF, self.lora_down, hidden, residual, keys_B=keys_B))
        return constrain(y_BLD, residual)
