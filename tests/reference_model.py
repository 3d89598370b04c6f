"""An independent jax.numpy reference for jaxpar's single-device dense training step.

`jaxpar verify` checks every parallel layout against jaxpar's own single-device step, so a
mistake in that step (model, loss or optimizer) would be on both sides and never show.
This file writes the same math again by hand, importing nothing from jaxpar, so that
tests/test_reference.py can check the single-device step itself.

Parameters are a flat dict keyed by jaxpar's parameter paths ('blocks/attn/w_qkv', ...);
per-layer weights are stacked on a leading layer axis (N). The model's options are read off
the dict: learned positions when 'pos_embedding' is present, an untied output when 'head' is,
grouped-query attention (fewer key/value heads) when 'blocks/attn/w_q' and 'blocks/attn/w_kv'
replace 'blocks/attn/w_qkv', a SwiGLU MLP when 'blocks/mlp/w_gate_up' replaces 'blocks/mlp/w_up'.
The rotary base and the RMSNorm epsilon are not in the parameters: forward, loss_fn and
train_step take them as arguments (rope_base, norm_eps).
Legend: B batch, L sequence (M: key positions), T sequence + 1, D model, H heads, G key/value heads,
R query heads per key/value head (H / G), K head dim, F ffn, V vocab.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

NORM_EPS = 1e-5
ROPE_BASE = 10000.0


def rms_norm(x_BLD, scale_D, eps=NORM_EPS):
    """x / rms(x) * scale over the model dimension, in fp32."""
    x_BLD = x_BLD.astype(jnp.float32)
    rms_BL1 = jnp.sqrt(jnp.mean(jnp.square(x_BLD), axis=-1, keepdims=True) + eps)
    return x_BLD / rms_BL1 * scale_D


def rope(x_BLHK, base=ROPE_BASE):
    """Rotary positions, half-split: dims (i, i + K/2) form the complex number x_i + j x_{i+K/2},
    which is multiplied by exp(j * position * base^(-i / (K/2)))."""
    L, K = x_BLHK.shape[1], x_BLHK.shape[3]
    freq_K2 = base ** (-np.arange(K // 2) / (K // 2))
    turn_LK2 = np.exp(1j * np.arange(L)[:, None] * freq_K2[None, :]).astype(np.complex64)
    z_BLHK2 = jax.lax.complex(x_BLHK[..., : K // 2], x_BLHK[..., K // 2:]) * turn_LK2[None, :, None, :]
    return jnp.concatenate([jnp.real(z_BLHK2), jnp.imag(z_BLHK2)], axis=-1)


def gelu_tanh(x):
    """GeLU, tanh approximation (jax.nn.gelu's default)."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def silu(x):
    """x * sigmoid(x)."""
    return x / (1.0 + jnp.exp(-x))


def attention(x_BLD, w: dict, rope_base):
    """Causal self-attention from the layer's weights w: one fused Q/K/V weight ('attn/w_qkv'), or
    Q ('attn/w_q') and fewer K/V heads ('attn/w_kv'); rope_base None for no rotary positions.

    Query heads come in G consecutive groups of R, group g reading key/value head g."""
    if "attn/w_qkv" in w:
        q_BLHK, k_BLGK, v_BLGK = (jnp.einsum("BLD,DHK->BLHK", x_BLD, w["attn/w_qkv"][:, i]) for i in range(3))
    else:
        q_BLHK = jnp.einsum("BLD,DHK->BLHK", x_BLD, w["attn/w_q"])
        k_BLGK, v_BLGK = (jnp.einsum("BLD,DGK->BLGK", x_BLD, w["attn/w_kv"][:, i]) for i in range(2))
    if rope_base is not None:
        q_BLHK, k_BLGK = rope(q_BLHK, rope_base), rope(k_BLGK, rope_base)
    B, L, H, K = q_BLHK.shape
    G = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
    scores_BGRLM = jnp.einsum("BLGRK,BMGK->BGRLM", q_BLGRK, k_BLGK) / math.sqrt(K)
    future_LM = np.triu(np.ones((L, L), bool), k=1)
    scores_BGRLM = jnp.where(future_LM, -jnp.inf, scores_BGRLM)
    weights_BGRLM = jnp.exp(scores_BGRLM - scores_BGRLM.max(-1, keepdims=True))
    weights_BGRLM = weights_BGRLM / weights_BGRLM.sum(-1, keepdims=True)
    out_BLHK = jnp.einsum("BGRLM,BMGK->BLGRK", weights_BGRLM, v_BLGK).reshape(B, L, H, K)
    return jnp.einsum("BLHK,HKD->BLD", out_BLHK, w["attn/wo"])


def mlp(x_BLD, w: dict):
    """GeLU MLP ('mlp/w_up'), or SwiGLU when the layer has 'mlp/w_gate_up' (slot 0 gate, slot 1 up)."""
    if "mlp/w_gate_up" in w:
        h_BLF = silu(x_BLD @ w["mlp/w_gate_up"][:, 0]) * (x_BLD @ w["mlp/w_gate_up"][:, 1])
    else:
        h_BLF = gelu_tanh(x_BLD @ w["mlp/w_up"])
    return h_BLF @ w["mlp/w_down"]


def block(x_BLD, w: dict, rope_base=ROPE_BASE, norm_eps=NORM_EPS) -> jax.Array:
    """One pre-norm transformer block from its weights w ('attn/...', 'attn_norm/scale', 'mlp/...', ...)."""
    x_BLD = x_BLD + attention(rms_norm(x_BLD, w["attn_norm/scale"], norm_eps), w, rope_base)
    return x_BLD + mlp(rms_norm(x_BLD, w["mlp_norm/scale"], norm_eps), w)


def forward(params: dict, tokens_BL, rope_base=ROPE_BASE, norm_eps=NORM_EPS) -> jax.Array:
    """Logits (B, L, V): embedding (+ learned positions), pre-norm blocks, final norm, output."""
    x_BLD = final_hidden(params, tokens_BL, rope_base, norm_eps)
    head_DV = params["head"] if "head" in params else params["embedding"].T
    return x_BLD @ head_DV


def final_hidden(params: dict, tokens_BL, rope_base=ROPE_BASE, norm_eps=NORM_EPS) -> jax.Array:
    """The last block's output after the final norm (B, L, D)."""
    L = tokens_BL.shape[1]
    x_BLD = params["embedding"][tokens_BL]
    if "pos_embedding" in params:
        x_BLD = x_BLD + params["pos_embedding"][:L]
    layer_names = [name.removeprefix("blocks/") for name in params if name.startswith("blocks/")]
    n_layers = params["blocks/attn/wo"].shape[0]
    for n in range(n_layers):
        w = {name: params["blocks/" + name][n] for name in layer_names}
        x_BLD = block(x_BLD, w, None if "pos_embedding" in params else rope_base, norm_eps)
    return rms_norm(x_BLD, params["final_norm/scale"], norm_eps)


def loss_fn(params: dict, tokens_BT, rope_base=ROPE_BASE, norm_eps=NORM_EPS) -> jax.Array:
    """Mean next-token cross-entropy: predict tokens[:, 1:] from tokens[:, :-1]."""
    logits_BLV = forward(params, tokens_BT[:, :-1], rope_base, norm_eps).astype(jnp.float32)
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
    """Linear warmup: step s < o.warmup takes o.lr (s + 1) / o.warmup, so step o.warmup - 1 is the peak; then
    cosine decay from the peak to o.lr / 10 at o.horizon."""
    warmup = min(o.warmup, o.horizon)
    peak = max(warmup - 1, 0)
    step = jnp.asarray(step, jnp.float32)
    cosine_steps = max(o.horizon, peak + 1) - peak
    progress = jnp.clip(step - peak, 0, cosine_steps) / cosine_steps
    end = 0.1 * o.lr
    cosine = end + (o.lr - end) * 0.5 * (1 + jnp.cos(math.pi * progress))
    return jnp.where(step < peak, o.lr * (step + 1) / max(warmup, 1), cosine)


def decays(name: str) -> bool:
    """Weight decay applies to matrices (embeddings, projections), not to norm scales."""
    return not name.endswith("/scale")


def init_optimizer(params: dict) -> dict:
    """Adam moments (zeros) and the number of updates done so far."""
    zeros = {name: jnp.zeros_like(p) for name, p in params.items()}
    return {"count": jnp.zeros((), jnp.int32), "m": zeros, "v": dict(zeros)}


def train_step(params: dict, opt: dict, tokens_BT, o: OptimConfig, rope_base=ROPE_BASE, norm_eps=NORM_EPS,
               grad_params: dict | None = None):
    """One step: gradients of the mean loss, clip to o.clip_norm, AdamW update.

    grad_params: the weights the gradients (and the loss) are taken at, if not `params` (PipeDream-2BW,
    Narayanan et al. 2021, section 3.1: W(t+1) = W(t) - lr * update(grad f(W(t-1))), the decay on W(t)).
    Returns (params, opt, metrics) with metrics 'loss', 'grad_norm' (before clipping) and 'lr'.
    """
    at = params if grad_params is None else grad_params
    loss, grads = jax.value_and_grad(loss_fn)(at, tokens_BT, rope_base, norm_eps)
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
