"""Mixture-of-experts routers: which tokens of a routing group go to which expert slot.

Every router maps router logits (G groups, S tokens, E experts) to
  dispatch (G, S, E, C): 1 where token s fills slot c of expert e,
  combine  (G, S, E, C): dispatch times the token's gate weight,
the balance loss, and the share of assignments dropped for lack of capacity (None for
Expert Choice, which never overflows). Balance losses are computed per
routing group and averaged, so they do not depend on how groups are spread over devices. Shape legend: G groups, S tokens
per group, E experts, C capacity (slots per expert per group), K top-k.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm


def capacity(router: str, group_size: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: capacity_factor x (assignments per group) / E, at least 1."""
    assignments = group_size * (top_k if router == "topk" else 1)
    return max(1, int(math.ceil(capacity_factor * assignments / experts)))


def _positions_in_expert(mask_GSE: jax.Array, already_G1E: jax.Array) -> jax.Array:
    """Slot index each (token, expert) assignment would take: tokens fill in order."""
    return jnp.cumsum(mask_GSE, axis=1) - mask_GSE + already_G1E


def _dispatch_from_choices(choices_GSK, gates_GSK, E: int, C: int):
    """Fill expert slots choice by choice (all first choices before second choices), dropping overflow."""
    G, S, K = choices_GSK.shape
    dispatch = jnp.zeros((G, S, E, C), jnp.float32)
    combine = jnp.zeros((G, S, E, C), jnp.float32)
    filled_G1E = jnp.zeros((G, 1, E), jnp.float32)
    kept = jnp.zeros((), jnp.float32)
    for k in range(K):
        mask_GSE = jax.nn.one_hot(choices_GSK[..., k], E, dtype=jnp.float32)
        position_GSE = _positions_in_expert(mask_GSE, filled_G1E)
        mask_GSE = mask_GSE * (position_GSE < C)
        slot_GSEC = jax.nn.one_hot(position_GSE.astype(jnp.int32), C, dtype=jnp.float32) * mask_GSE[..., None]
        dispatch = dispatch + slot_GSEC
        combine = combine + slot_GSEC * gates_GSK[..., k, None, None]
        filled_G1E = filled_G1E + jnp.sum(mask_GSE, axis=1, keepdims=True)
        kept = kept + jnp.sum(mask_GSE)
    dropped = 1.0 - kept / (G * S * K)
    return dispatch, combine, dropped


def _cv_squared(x_GE: jax.Array) -> jax.Array:
    """Squared coefficient of variation across experts, averaged over groups."""
    return jnp.mean(jnp.var(x_GE, axis=-1) / (jnp.mean(x_GE, axis=-1) ** 2 + 1e-10))


def switch(logits_GSE: jax.Array, C: int):
    """Switch Transformer top-1: capacity C per expert, overflow dropped (the residual carries it).
    Load-balancing loss E * sum_i f_i * P_i (f: fraction routed, P: mean router probability)."""
    E = logits_GSE.shape[-1]
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    choice_GS1 = jnp.argmax(probs_GSE, axis=-1)[..., None]
    gate_GS1 = jnp.take_along_axis(probs_GSE, choice_GS1, axis=-1)
    dispatch, combine, dropped = _dispatch_from_choices(choice_GS1, gate_GS1, E, C)
    fraction_GE = jnp.mean(jax.nn.one_hot(choice_GS1[..., 0], E), axis=1)
    balance = E * jnp.mean(jnp.sum(fraction_GE * jnp.mean(probs_GSE, axis=1), axis=-1))
    return dispatch, combine, balance, dropped


def noisy_topk(logits_GSE: jax.Array, noise_scale_GSE: jax.Array | None, noise_GSE: jax.Array | None,
               k: int, C: int):
    """Noisy top-k gating (Shazeer et al. 2017): H = logits + N(0,1) * softplus(noise logits); keep
    the top k of H, softmax over them. Auxiliary loss: CV^2 of importance (sum of gates) plus
    CV^2 of load (the smooth probability of each expert being in the top k)."""
    E = logits_GSE.shape[-1]
    noisy_GSE = logits_GSE
    if noise_GSE is not None:
        stddev_GSE = jax.nn.softplus(noise_scale_GSE) + 1e-2
        noisy_GSE = logits_GSE + noise_GSE * stddev_GSE
    top_GSK, choices_GSK = jax.lax.top_k(noisy_GSE, k)
    gates_GSK = jax.nn.softmax(top_GSK, axis=-1)
    dispatch, combine, dropped = _dispatch_from_choices(choices_GSK, gates_GSK, E, C)
    importance_GE = jnp.sum(combine, axis=(1, 3))
    if noise_GSE is not None and k < E:
        # P(expert e stays in the top k if its noise were redrawn): the paper's smooth load estimator
        top_k1_GSK = jax.lax.top_k(noisy_GSE, k + 1)[0]
        in_top_GSE = noisy_GSE >= top_k1_GSK[..., k - 1:k]
        threshold_GSE = jnp.where(in_top_GSE, top_k1_GSK[..., k:k + 1], top_k1_GSK[..., k - 1:k])
        load_GE = jnp.sum(norm.cdf((logits_GSE - threshold_GSE) / stddev_GSE), axis=1)
    else:
        load_GE = jnp.sum(jax.nn.one_hot(choices_GSK, E), axis=(1, 2))
    return dispatch, combine, _cv_squared(importance_GE) + _cv_squared(load_GE), dropped


def selection_key(probs: jax.Array) -> jax.Array:
    """What Expert Choice ranks tokens by: the probability rounded to bfloat16 (8 significant bits).

    Tokens with the same input and context (the same byte opening two sequences) have equal
    probabilities, bit for bit on one layout and an ulp apart on another, where the reduction
    order differs. Ranked on exact fp32 values, such ties go one way here and the other way
    there. Rounded, near-equal values become equal and `top_k` breaks the tie by token index
    (the lower wins), the same on every layout; a flip now needs fp32 noise to straddle a
    bf16 rounding boundary, about 1e-7 / 4e-3 of the time per tie.
    """
    return probs.astype(jnp.bfloat16).astype(jnp.float32)


def expert_choice(logits_GSE: jax.Array, C: int):
    """Expert Choice: each expert takes its top-C tokens of the group, so every expert is exactly
    full and nothing overflows (a token may be taken by several experts or by none; the
    caller measures the unrouted share from the dispatch). It looks at the whole group, so
    it is not causal. Gates are the exact probabilities of the chosen tokens."""
    probs_GES = jnp.swapaxes(jax.nn.softmax(logits_GSE, axis=-1), 1, 2)
    _, tokens_GEC = jax.lax.top_k(selection_key(probs_GES), C)
    gates_GEC = jnp.take_along_axis(probs_GES, tokens_GEC, axis=-1)
    S = logits_GSE.shape[1]
    dispatch_GSEC = jnp.transpose(jax.nn.one_hot(tokens_GEC, S, dtype=jnp.float32), (0, 3, 1, 2))
    combine_GSEC = dispatch_GSEC * gates_GEC[:, None, :, :]
    return dispatch_GSEC, combine_GSEC, jnp.zeros((), jnp.float32), None


def z_loss(logits_GSE: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): mean squared log-partition, keeps router logits small."""
    return jnp.mean(jax.nn.logsumexp(logits_GSE, axis=-1) ** 2)
