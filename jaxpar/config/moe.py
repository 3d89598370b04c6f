"""The model.moe section: a mixture of experts on every k-th layer's MLP, and its router (the
feature's checks and derived group size: jaxpar.features.experts)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: E experts (0 = dense) on every k-th layer's MLP, and the router."""
    experts: int = 0
    every: int = 2
    router: Literal["topk", "switch", "expert_choice", "dropless"] = "switch"
    top_k: int = 2
    capacity_factor: float = 1.25
    group_size: int = 0  # tokens per routing group; 0: the largest divisor of the tokens per device, at most 256
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    noise: bool = True
    # each expert's MLP (swiglu: Mixtral, Qwen-MoE, DeepSeek; gpt_oss: its clamped SwiGLU with biases)
    mlp: Literal["gelu", "swiglu", "gpt_oss"] = "gelu"
    d_ff: int = 0  # each expert's hidden width; 0: model.d_ff (fine-grained experts: smaller, and more of them)
    shared: int = 0  # always-on experts of width d_ff beside the routed ones, split over tensor like the dense MLP
    score: Literal["softmax", "sigmoid"] = "softmax"  # top-k's scores (sigmoid: DeepSeek-V3)
    renormalize: bool = True  # top-k: the chosen experts' weights scaled to sum to 1 (Mixtral, Qwen3-MoE)
    logit_bias: bool = False  # a learned bias on the router's logits (gpt-oss)
    swiglu_limit: float = 7.0  # mlp=gpt_oss: the gate clamped from above at this, the up projection to [-it, it]
    swiglu_alpha: float = 1.702  # mlp=gpt_oss: the gate's sigmoid slope
    # group-limited routing (DeepSeek-V3): the experts in expert_groups equal groups, each token choosing its
    # top_k among the topk_groups groups whose two best scores sum highest
    expert_groups: int = 1
    topk_groups: int = 1
    first_dense: int = 0  # the first layers keep a dense MLP (DeepSeek-V3: 3), the experts start after them
    routed_scale: float = 1.0  # the routed experts' output multiplied by this (DeepSeek-V3: 2.5)
    balance: Literal["aux", "bias"] = "aux"  # top-k's: an auxiliary loss, or a bias on the scores (DeepSeek-V3)
    bias_rate: float = 0.003  # the bias's move per step (measured on the default model: docs/moe.md)

    @property
    def chooses_top_k(self) -> bool:  # each token picks k experts (topk: into capacity slots; dropless: all run)
        return self.router in ("topk", "dropless")

    @property
    def aux_weight(self) -> float:  # the balance loss's weight in the objective: none under bias balancing
        return self.aux_loss_weight if self.balance == "aux" else 0.0
