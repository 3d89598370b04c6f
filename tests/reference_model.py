"""An independent jax.numpy reference for jaxpar's single-device dense training step.

`jaxpar verify` checks every parallel layout against jaxpar's own single-device step, so a
mistake in that step (model, loss or optimizer) would be on both sides and never show.
This file writes the same math again by hand, importing nothing from jaxpar, so that
tests/test_reference.py can check the single-device step itself.

Parameters are a flat dict keyed by jaxpar's parameter paths ('blocks/attn/w_qkv', ...);
per-layer weights are stacked on a leading layer axis (N). The model's options are read off
the dict: learned positions when 'pos_embedding' is present, an untied output when 'head' is.
Legend: B batch, L sequence (M: key positions), T sequence + 1, D model, H heads, K head dim, F ffn, V vocab.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

NORM_EPS = 1e-5
ROPE_BASE = 10000.0
LAYER_WEIGHTS = ("attn_norm/scale", "attn/w_qkv", "attn/wo", "mlp_norm/scale", "mlp/w_up", "mlp/w_down")


def rms_norm(x_BLD, scale_D):
    """x / rms(x) * scale over the model dimension, in fp32."""
    x_BLD = x_BLD.astype(jnp.float32)
    rms_BL1 = jnp.sqrt(jnp.mean(jnp.square(x_BLD), axis=-1, keepdims=True) + NORM_EPS)
    return x_BLD / rms_BL1 * scale_D


def rope(x_BLHK):
    """Rotary positions, half-split: dims (i, i + K/2) form the complex number x_i + j x_{i+K/2},
    which is multiplied by exp(j * position * ROPE_BASE^(-i / (K/2)))."""
    L, K = x_BLHK.shape[1], x_BLHK.shape[3]
    freq_K2 = ROPE_BASE ** (-np.arange(K // 2) / (K // 2))
    turn_LK2 = np.exp(1j * np.arange(L)[:, None] * freq_K2[None, :]).astype(np.complex64)
    z_BLHK2 = jax.lax.complex(x_BLHK[..., : K // 2], x_BLHK[..., K // 2:]) * turn_LK2[None, :, None, :]
    return jnp.concatenate([jnp.real(z_BLHK2), jnp.imag(z_BLHK2)], axis=-1)


def gelu_tanh(x):
    """GeLU, tanh approximation (jax.nn.gelu's default)."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def attention(x_BLD, w_qkv_D3HK, wo_HKD, use_rope: bool):
    """Causal multi-head self-attention with a fused Q/K/V weight."""
    q_BLHK, k_BLHK, v_BLHK = (jnp.einsum("BLD,DHK->BLHK", x_BLD, w_qkv_D3HK[:, i]) for i in range(3))
    if use_rope:
        q_BLHK, k_BLHK = rope(q_BLHK), rope(k_BLHK)
    L, K = x_BLD.shape[1], q_BLHK.shape[-1]
    scores_BHLM = jnp.einsum("BLHK,BMHK->BHLM", q_BLHK, k_BLHK) / math.sqrt(K)
    future_LM = np.triu(np.ones((L, L), bool), k=1)
    scores_BHLM = jnp.where(future_LM, -jnp.inf, scores_BHLM)
    weights_BHLM = jnp.exp(scores_BHLM - scores_BHLM.max(-1, keepdims=True))
    weights_BHLM = weights_BHLM / weights_BHLM.sum(-1, keepdims=True)
    out_BLHK = jnp.einsum("BHLM,BMHK->BLHK", weights_BHLM, v_BLHK)
    return jnp.einsum("BLHK,HKD->BLD", out_BLHK, wo_HKD)


def forward(params: dict, tokens_BL) -> jax.Array:
    """Logits (B, L, V): embedding (+ learned positions), pre-norm blocks, final norm, output."""
    L = tokens_BL.shape[1]
    x_BLD = params["embedding"][tokens_BL]
    if "pos_embedding" in params:
        x_BLD = x_BLD + params["pos_embedding"][:L]
    n_layers = params["blocks/attn/w_qkv"].shape[0]
    for n in range(n_layers):
        w = {name: params["blocks/" + name][n] for name in LAYER_WEIGHTS}
        h_BLD = rms_norm(x_BLD, w["attn_norm/scale"])
        x_BLD = x_BLD + attention(h_BLD, w["attn/w_qkv"], w["attn/wo"], use_rope="pos_embedding" not in params)
        h_BLD = rms_norm(x_BLD, w["mlp_norm/scale"])
        x_BLD = x_BLD + gelu_tanh(h_BLD @ w["mlp/w_up"]) @ w["mlp/w_down"]
    x_BLD = rms_norm(x_BLD, params["final_norm/scale"])
    head_DV = params["head"] if "head" in params else params["embedding"].T
    return x_BLD @ head_DV


def loss_fn(params: dict, tokens_BT) -> jax.Array:
    """Mean next-token cross-entropy: predict tokens[:, 1:] from tokens[:, :-1]."""
    logits_BLV = forward(params, tokens_BT[:, :-1]).astype(jnp.float32)
    targets_BL = tokens_BT[:, 1:]
    top_BL1 = logits_BLV.max(-1, keepdims=True)
    log_z_BL = jnp.log(jnp.exp(logits_BLV - top_BL1).sum(-1)) + top_BL1[..., 0]
    target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jnp.mean(log_z_BL - target_logit_BL)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Global-norm clipping, then AdamW on a warmup + cosine schedule ending at lr / 10."""

    lr: float
    warmup: int
    horizon: int  # steps until the cosine reaches its end value
    clip_norm: float
    weight_decay: float
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


def learning_rate(step, o: OptimConfig):
    """Linear warmup from 0 to o.lr over o.warmup steps, then cosine decay to o.lr / 10 at o.horizon."""
    warmup = min(o.warmup, o.horizon)
    step = jnp.asarray(step, jnp.float32)
    cosine_steps = max(o.horizon, warmup + 1) - warmup
    progress = jnp.clip(step - warmup, 0, cosine_steps) / cosine_steps
    end = 0.1 * o.lr
    cosine = end + (o.lr - end) * 0.5 * (1 + jnp.cos(math.pi * progress))
    return jnp.where(step < warmup, o.lr * step / max(warmup, 1), cosine)


def decays(name: str) -> bool:
    """Weight decay applies to matrices (embeddings, projections), not to norm scales."""
    return not name.endswith("/scale")


def init_optimizer(params: dict) -> dict:
    """Adam moments (zeros) and the number of updates done so far."""
    zeros = {name: jnp.zeros_like(p) for name, p in params.items()}
    return {"count": jnp.zeros((), jnp.int32), "m": zeros, "v": dict(zeros)}


def train_step(params: dict, opt: dict, tokens_BT, o: OptimConfig):
    """One step: gradients of the mean loss, clip to o.clip_norm, AdamW update.

    Returns (params, opt, metrics) with metrics 'loss', 'grad_norm' (before clipping) and 'lr'.
    """
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BT)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads.values()))
    clip = jnp.minimum(1.0, o.clip_norm / grad_norm)
    count = opt["count"] + 1
    lr = learning_rate(opt["count"], o)
    new_params, m, v = {}, {}, {}
    for name, p in params.items():
        g = grads[name] * clip
        m[name] = o.b1 * opt["m"][name] + (1 - o.b1) * g
        v[name] = o.b2 * opt["v"][name] + (1 - o.b2) * g * g
        m_hat = m[name] / (1 - o.b1 ** count)
        v_hat = v[name] / (1 - o.b2 ** count)
        step = m_hat / (jnp.sqrt(v_hat) + o.eps)
        if decays(name):
            step = step + o.weight_decay * p
        new_params[name] = p - lr * step
    return new_params, {"count": count, "m": m, "v": v}, {"loss": loss, "grad_norm": grad_norm, "lr": lr}
