"""A mixture-of-experts MLP: route tokens in fixed-size groups, run E GeLU or SwiGLU experts,
combine, and add the shared experts' output (always-on experts, one dense MLP of their summed width).

Routing groups are `group_size` consecutive tokens, independent of the mesh, so a token is
routed the same way on one device and on many. Expert weights have a leading expert
dimension (logical 'expert'); under expert parallelism each device holds E / mesh.expert
experts and the layout's `expert_all_to_all` hook moves each expert's tokens to it and back.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpar.model.routers as routers
from jaxpar.config.model import ModelConfig
from jaxpar.model.adapters import adapted, adapters
from jaxpar.model.axes import (
    constrain,
    expert_all_to_all,
    expert_exchange,
    expert_gather,
    expert_shard,
    gemm,
    param,
    zeros_param,
)
from jaxpar.model.dropless import dropless_experts, per_row, ragged_dropless_experts
from jaxpar.model.mlp import MLP
from jaxpar.model.routing_trace import RoutingTrace


class MoE(nnx.Module):
    """Router + E experts. Returns the combined output and routing statistics."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe, D, F = cfg.moe, cfg.d_model, cfg.expert_d_ff
        E = moe.experts
        self.router, self.top_k, self.noise = moe.router, moe.top_k, moe.noise
        self.group_size, self.capacity_factor = moe.group_size, moe.capacity_factor
        self.score, self.renormalize, self.routed_scale = moe.score, moe.renormalize, moe.routed_scale
        self.groups = (moe.expert_groups, moe.topk_groups)
        self.w_router = param(rngs.params(), (D, E), ("embed", None), D ** -0.5)
        self.b_router = zeros_param((E,), (None,)) if moe.logit_bias else None
        self.w_noise = zeros_param((D, E), ("embed", None)) if moe.chooses_top_k else None
        self.gated, self.clamped = moe.mlp != "gelu", moe.mlp == "gpt_oss"
        self.swiglu = (moe.swiglu_limit, moe.swiglu_alpha)
        if self.gated:  # slot 0: gate, slot 1: up (as the dense MLP)
            self.w_gate_up = param(rngs.params(), (E, D, 2, F), ("expert", "embed", None, "mlp"), D ** -0.5)
        else:
            self.w_up = param(rngs.params(), (E, D, F), ("expert", "embed", "mlp"), D ** -0.5)
        self.w_down = param(rngs.params(), (E, F, D), ("expert", "mlp", "embed"),
                            F ** -0.5 / math.sqrt(2 * cfg.n_layers))
        # gpt-oss: biases on each expert's gate, up and down projections
        self.b_gate_up = zeros_param((E, 2, F), ("expert", None, "mlp")) if self.clamped else None
        self.b_down = zeros_param((E, D), ("expert", "embed")) if self.clamped else None
        into = (((E,), (D,), (F,)), (("expert",), ("embed",), ("mlp",)))
        lora = adapters(cfg.lora, rngs, {"gate": into, "up": into,
                                         "down": (((E,), (F,), (D,)), (("expert",), ("mlp",), ("embed",)))}, "experts")
        self.lora_gate, self.lora_up, self.lora_down = (lora["gate"] if self.gated else None), lora["up"], lora["down"]
        # Shared experts: N always-on experts of width F sum to one MLP of width N x F.
        self.shared = (MLP(dataclasses.replace(cfg, d_ff=moe.shared * F, mlp=moe.mlp), rngs=rngs)
                       if moe.shared else None)
        # Bias balancing: added to the scores for choosing experts alone; the step moves it (jaxpar.train.step).
        self.router_bias = zeros_param((E,), (None,)) if moe.balance == "bias" else None

    def __call__(self, x_BLD: jax.Array, noise_B: jax.Array | None = None, routing: RoutingTrace | None = None):
        """noise_B: a PRNG key per batch row for noisy top-k (training), None for no noise.
        routing: when the caller traces routing token by token (verify), the stats then hold the
        decisions as `routing_codes` (U, R, L, E), and where the trace replays decisions, the router's
        own `routing_flips` and `routing_margins` (U, R, L) (jaxpar.model.routing_trace)."""
        if self.group_size <= 0:
            raise ValueError("model.moe.group_size=0 (automatic) must be resolved for the mesh before the model "
                             "runs: see jaxpar.features.experts.derive")
        B, L, D = x_BLD.shape
        # Training batches hold whole groups (validated); a shorter input (generating one
        # sequence) is routed as one group per sequence.
        N = self.group_size if (B * L) % self.group_size == 0 else L
        x_GND = x_BLD.reshape(B * L // N, N, D)
        G = x_GND.shape[0]
        x32_GND = x_GND.astype(jnp.float32)
        logits_GNE = jnp.einsum("GND,DE->GNE", x32_GND, self.w_router[...].astype(jnp.float32))
        if self.b_router is not None:
            logits_GNE = logits_GNE + self.b_router[...].astype(jnp.float32)
        E = logits_GNE.shape[-1]
        C = routers.capacity(self.router, N, E, self.top_k, self.capacity_factor)
        replay_GNE = None if routing is None else routing.replayed(G)
        if self.router == "switch":
            routed = routers.switch(logits_GNE, C, replay_GNE)
        elif self.router == "expert_choice":
            routed = routers.expert_choice(logits_GNE, C, replay_GNE)
        else:
            noise_GNE = noise_scale_GNE = None
            if self.noise and noise_B is not None:
                # Noise keyed by the row (each row's key is its own): the same on any mesh.
                noise_BLE = jax.vmap(lambda key: jax.random.normal(key, (L, E)))(noise_B)
                noise_GNE = noise_BLE.reshape(G, N, E)
                noise_scale_GNE = jnp.einsum("GND,DE->GNE", x32_GND, self.w_noise[...].astype(jnp.float32))
            bias_E = None if self.router_bias is None else self.router_bias[...].astype(jnp.float32)
            choices = routers.topk_choices(logits_GNE, noise_scale_GNE, noise_GNE, self.top_k, self.score,
                                           self.renormalize, bias_E, replay_GNE, self.groups)
            if self.router == "dropless":
                return self._dropless(x_BLD, x_GND, logits_GNE, choices, routing)
            routed = routers.into_slots(choices, E, C)
        dispatch, combine, balance, dropped = routed.dispatch, routed.combine, routed.balance, routed.dropped
        if self.routed_scale != 1.0:
            combine = combine * self.routed_scale
        dtype = x_BLD.dtype
        x_EGCD = jnp.einsum("GNEC,GND->EGCD", dispatch.astype(dtype), x_GND)
        x_EGCD = expert_all_to_all(x_EGCD, inverse=False)  # local experts, every shard's groups
        matmul = gemm()  # the experts' matmuls as the precision policy runs them (fp8: jaxpar.model.fp8)
        h_EGCF = self._hidden(lambda w_EDF: matmul.einsum("EGCD,EDF->EGCF", x_EGCD, w_EDF),
                              lambda b_EF: b_EF[:, None, None])
        y_EGCD = matmul.einsum("EGCF,EFD->EGCD", h_EGCF, adapted(self.w_down, self.lora_down)[...])
        y_EGCD = expert_all_to_all(y_EGCD, inverse=True)  # back to the shard that owns the groups
        y_GND = jnp.einsum("GNEC,EGCD->GND", combine.astype(dtype), y_EGCD)
        if self.b_down is not None:  # each chosen expert's down bias, weighted by its gate
            y_GND = y_GND + jnp.einsum("GNEC,ED->GND", combine.astype(dtype), self.b_down[...].astype(dtype))
        tokens_E = jnp.sum(dispatch, axis=(0, 1, 3))
        # The share of tokens no expert took (the residual alone carries them), from the dispatch itself.
        unrouted = jnp.mean((jnp.sum(dispatch, axis=(2, 3)) == 0).astype(jnp.float32))
        stats = self._stats(balance, logits_GNE, unrouted, tokens_E, routed.chosen_E, routing, routed.codes_GNE,
                            routed.flips)
        if dropped is not None:
            stats["dropped"] = dropped
        return self._with_shared(y_GND, x_BLD), stats

    def _dropless(self, x_BLD, x_GND, logits_GNE, choices: routers.Choices, routing: RoutingTrace | None):
        """Every assignment computed (jaxpar.model.dropless): no capacity, nothing dropped."""
        G, N, D = x_GND.shape
        x_TD, experts_TK, gates_TK = (a.reshape(G * N, *a.shape[2:]) for a in
                                      (x_GND, choices.experts_GNK, choices.gates_GNK * self.routed_scale))
        w_down = adapted(self.w_down, self.lora_down)[...]
        b_down = None if self.b_down is None else self.b_down[...]

        def hidden(x_AD, sizes_E):
            return self._hidden(lambda w_EDF: gemm().ragged_dot(x_AD, w_EDF, sizes_E),
                                lambda b_EF: per_row(b_EF, sizes_E, x_AD.shape[0]))

        exchange = expert_exchange()
        if exchange is not None:  # each assignment sent to its expert's device by ragged all-to-all
            y_TD = ragged_dropless_experts(x_TD, experts_TK, gates_TK, hidden, w_down, exchange, b_down)
        else:  # every shard's tokens on every expert device (nothing moves without expert parallelism)
            x_TD, experts_TK, gates_TK = (expert_gather(a, inverse=False) for a in (x_TD, experts_TK, gates_TK))
            first = expert_shard() * w_down.shape[0]  # the experts held here (all without expert parallelism)
            y_TD = dropless_experts(x_TD, experts_TK, gates_TK, hidden, w_down, first, b_down)
            y_TD = expert_gather(y_TD, inverse=True)
        chosen_GNKE = jax.nn.one_hot(choices.experts_GNK, logits_GNE.shape[-1])
        taken_GNE = jnp.sum(chosen_GNKE, axis=2)
        importance_GE = jnp.sum(chosen_GNKE * choices.gates_GNK[..., None], axis=(1, 2))
        unrouted = jnp.mean((jnp.sum(taken_GNE, axis=-1) == 0).astype(jnp.float32))
        codes_GNE = routers.ranked_codes(choices.experts_GNK, logits_GNE.shape[-1])
        stats = self._stats(choices.balance(importance_GE), logits_GNE, unrouted, choices.chosen_E, choices.chosen_E,
                            routing, codes_GNE, choices.flips)
        return self._with_shared(y_TD.reshape(G, N, D), x_BLD), stats

    def _stats(self, balance, logits_GNE, unrouted, tokens_E, chosen_E, routing: RoutingTrace | None,
               codes_GNE: jax.Array, flips: routers.Flips | None) -> dict:
        """The layer's routing statistics; traced (verify), also its decision's codes and flips."""
        stats = {"aux": balance, "z": routers.z_loss(logits_GNE), "unrouted": unrouted, "expert_tokens": tokens_E,
                 "max_load": jnp.max(chosen_E) / jnp.maximum(jnp.mean(chosen_E), 1e-9)}
        if routing is not None:
            stats["routing_codes"] = routing.place(codes_GNE)
            if flips is not None:
                stats["routing_flips"] = routing.place(flips.flipped_GN)
                stats["routing_margins"] = routing.place(flips.margin_GN)
        if self.router_bias is not None:
            stats["bias_term"] = bias_balance_term(self.router_bias[...], chosen_E)
        return stats

    def _with_shared(self, y_GND: jax.Array, x_BLD: jax.Array) -> jax.Array:
        y_BLD = constrain(y_GND.reshape(x_BLD.shape), ("batch", "residual_seq", "embed"))
        return y_BLD if self.shared is None else y_BLD + self.shared(x_BLD)

    def _hidden(self, matmul, biases=None) -> jax.Array:
        """Each expert's hidden activations, gelu(x W_up), silu(x W_gate) * (x W_up), or gpt-oss's
        clamped form (gpt_oss_glu), where matmul(w_EDF) multiplies the tokens by every expert's weight
        (dense slots or sorted rows) and biases(b_EF) lays each expert's bias out like its output."""
        if self.clamped:
            w, b = adapted(self.w_gate_up, (self.lora_gate, self.lora_up), -2)[...], self.b_gate_up[...]
            return gpt_oss_glu(*(matmul(w[:, :, i]) + biases(b[:, i]).astype(w.dtype) for i in range(2)), *self.swiglu)
        if self.gated:
            w = adapted(self.w_gate_up, (self.lora_gate, self.lora_up), -2)[...]
            return jax.nn.silu(matmul(w[:, :, 0])) * matmul(w[:, :, 1])
        return jax.nn.gelu(matmul(adapted(self.w_up, self.lora_up)[...]))



def gpt_oss_glu(gate: jax.Array, up: jax.Array, limit: float = 7.0, alpha: float = 1.702) -> jax.Array:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit): gpt-oss's clamped
    SwiGLU (model.moe.swiglu_limit, swiglu_alpha; published: 7 and 1.702)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def bias_balance_term(bias_E: jax.Array, chosen_E: jax.Array) -> jax.Array:
    """Zero, whose gradient with respect to the bias is each expert's load above the mean: summed
    over microbatches and devices like any gradient, its sign is the whole batch's, the same on
    every layout. The train step moves the bias against that sign (jaxpar.train.step)."""
    excess_E = jax.lax.stop_gradient(chosen_E - jnp.mean(chosen_E))
    return jnp.sum(excess_E * (bias_E - jax.lax.stop_gradient(bias_E)))
