"""Mixture-of-experts routers: which tokens of a routing group go to which expert slot.

Every router maps router logits (G groups, N tokens, E experts) to a `Routed`:
  dispatch (G, N, E, C): 1 where token n fills slot c of expert e,
  combine  (G, N, E, C): dispatch times the token's gate weight,
the balance loss, the share of assignments dropped for lack of capacity (None for Expert
Choice, which never overflows), and each expert's count of assignments chosen before any was
dropped. Balance losses are computed per routing group and averaged, so they do not depend on
how groups are spread over devices.
Shape legend: G groups, N tokens per group, E experts, C capacity (slots per expert per group), K top-k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm


class Routed(NamedTuple):
    dispatch: jax.Array  # (G, N, E, C)
    combine: jax.Array  # (G, N, E, C)
    balance: jax.Array  # the auxiliary balance loss (0 for Expert Choice)
    dropped: jax.Array | None  # the share of assignments past capacity (None: Expert Choice)
    chosen_E: jax.Array  # assignments each expert was chosen for, before capacity dropped any


def capacity(router: str, group_size: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: capacity_factor x (assignments per group) / E, at least 1."""
    assignments = group_size * (top_k if router == "topk" else 1)
    return max(1, int(math.ceil(capacity_factor * assignments / experts)))


def _positions_in_expert(mask_GNE: jax.Array, already_G1E: jax.Array) -> jax.Array:
    """Slot index each (token, expert) assignment would take: tokens fill in order."""
    return jnp.cumsum(mask_GNE, axis=1) - mask_GNE + already_G1E


def _dispatch_from_choices(choices_GNK, gates_GNK, E: int, C: int):
    """Fill expert slots choice by choice (all first choices before second choices), dropping overflow."""
    G, N, K = choices_GNK.shape
    dispatch = jnp.zeros((G, N, E, C), jnp.float32)
    combine = jnp.zeros((G, N, E, C), jnp.float32)
    filled_G1E = jnp.zeros((G, 1, E), jnp.float32)
    kept = jnp.zeros((), jnp.float32)
    for k in range(K):
        mask_GNE = jax.nn.one_hot(choices_GNK[..., k], E, dtype=jnp.float32)
        position_GNE = _positions_in_expert(mask_GNE, filled_G1E)
        mask_GNE = mask_GNE * (position_GNE < C)
        slot_GNEC = jax.nn.one_hot(position_GNE.astype(jnp.int32), C, dtype=jnp.float32) * mask_GNE[..., None]
        dispatch = dispatch + slot_GNEC
        combine = combine + slot_GNEC * gates_GNK[..., k, None, None]
        filled_G1E = filled_G1E + jnp.sum(mask_GNE, axis=1, keepdims=True)
        kept = kept + jnp.sum(mask_GNE)
    dropped = 1.0 - kept / (G * N * K)
    return dispatch, combine, dropped


def _cv_squared(x_GE: jax.Array) -> jax.Array:
    """Squared coefficient of variation across experts, averaged over groups."""
    return jnp.mean(jnp.var(x_GE, axis=-1) / (jnp.mean(x_GE, axis=-1) ** 2 + 1e-10))


def switch(logits_GNE: jax.Array, C: int):
    """Switch Transformer top-1: capacity C per expert, overflow dropped (the residual carries it).
    Load-balancing loss E * sum_i f_i * P_i (f: fraction routed, P: mean router probability)."""
    E = logits_GNE.shape[-1]
    probs_GNE = jax.nn.softmax(logits_GNE, axis=-1)
    choice_GN1 = jnp.argmax(selection_key(probs_GNE), axis=-1)[..., None]
    gate_GN1 = jnp.take_along_axis(probs_GNE, choice_GN1, axis=-1)
    dispatch, combine, dropped = _dispatch_from_choices(choice_GN1, gate_GN1, E, C)
    chosen_GNE = jax.nn.one_hot(choice_GN1[..., 0], E)
    fraction_GE = jnp.mean(chosen_GNE, axis=1)
    balance = E * jnp.mean(jnp.sum(fraction_GE * jnp.mean(probs_GNE, axis=1), axis=-1))
    return Routed(dispatch, combine, balance, dropped, jnp.sum(chosen_GNE, axis=(0, 1)))


class Choices(NamedTuple):
    """Top-k's choices before any capacity: each token's k experts and their weights."""
    experts_GNK: jax.Array
    gates_GNK: jax.Array
    load_GE: jax.Array  # the balance loss's load: the smooth estimate under noise, else the counts
    chosen_E: jax.Array

    def balance(self, importance_GE: jax.Array) -> jax.Array:
        """The auxiliary loss: CV^2 of importance (the gates each expert received) plus CV^2 of load."""
        return _cv_squared(importance_GE) + _cv_squared(self.load_GE)


def topk_choices(logits_GNE: jax.Array, noise_scale_GNE: jax.Array | None, noise_GNE: jax.Array | None,
                 k: int, score: str = "softmax", renormalize: bool = True, bias_E: jax.Array | None = None) -> Choices:
    """Noisy top-k gating (Shazeer et al. 2017): H = logits + N(0,1) * softplus(noise logits); keep
    the top k of H, softmax over them. Auxiliary loss: CV^2 of importance (sum of gates) plus
    CV^2 of load (the smooth probability of each expert being in the top k).

    As open checkpoints define it: scores are the softmax (or the sigmoid, DeepSeek-V3) of H; the
    gates are the chosen experts' scores, scaled to sum to 1 when `renormalize` (Mixtral,
    Qwen3-MoE). bias_E (bias balancing) is added to the scores for choosing alone, not to the gates.
    """
    E = logits_GNE.shape[-1]
    noisy_GNE = logits_GNE
    if noise_GNE is not None:
        stddev_GNE = jax.nn.softplus(noise_scale_GNE) + 1e-2
        noisy_GNE = logits_GNE + noise_GNE * stddev_GNE
    scores_GNE = jax.nn.sigmoid(noisy_GNE) if score == "sigmoid" else jax.nn.softmax(noisy_GNE, axis=-1)
    # ranked by score (for softmax, the same order as the noisy logits, on a scale where bf16 rounding is relative)
    _, choices_GNK = jax.lax.top_k(selection_key(scores_GNE if bias_E is None else scores_GNE + bias_E), k)
    if score == "softmax" and renormalize:  # the softmax over the chosen logits
        gates_GNK = jax.nn.softmax(jnp.take_along_axis(noisy_GNE, choices_GNK, axis=-1), axis=-1)
    else:
        gates_GNK = jnp.take_along_axis(scores_GNE, choices_GNK, axis=-1)
        if renormalize:
            gates_GNK = gates_GNK / jnp.sum(gates_GNK, axis=-1, keepdims=True)
    chosen_GE = jnp.sum(jax.nn.one_hot(choices_GNK, E), axis=(1, 2))
    if noise_GNE is not None and k < E:
        # P(expert e stays in the top k if its noise were redrawn): the paper's smooth load estimator
        top_k1_GNK = jax.lax.top_k(noisy_GNE, k + 1)[0]
        in_top_GNE = noisy_GNE >= top_k1_GNK[..., k - 1:k]
        threshold_GNE = jnp.where(in_top_GNE, top_k1_GNK[..., k:k + 1], top_k1_GNK[..., k - 1:k])
        load_GE = jnp.sum(norm.cdf((logits_GNE - threshold_GNE) / stddev_GNE), axis=1)
    else:
        load_GE = chosen_GE
    return Choices(choices_GNK, gates_GNK, load_GE, jnp.sum(chosen_GE, axis=0))


def noisy_topk(logits_GNE: jax.Array, noise_scale_GNE: jax.Array | None, noise_GNE: jax.Array | None,
               k: int, C: int, score: str = "softmax", renormalize: bool = True,
               bias_E: jax.Array | None = None) -> Routed:
    """Top-k's choices (topk_choices) into C slots per expert, overflow dropped."""
    choices = topk_choices(logits_GNE, noise_scale_GNE, noise_GNE, k, score, renormalize, bias_E)
    return into_slots(choices, logits_GNE.shape[-1], C)


def into_slots(choices: Choices, E: int, C: int) -> Routed:
    """Top-k's choices into C slots per expert (all first choices before second choices), overflow dropped."""
    dispatch, combine, dropped = _dispatch_from_choices(choices.experts_GNK, choices.gates_GNK, E, C)
    importance_GE = jnp.sum(combine, axis=(1, 3))  # the gates of kept assignments
    return Routed(dispatch, combine, choices.balance(importance_GE), dropped, choices.chosen_E)


def selection_key(scores: jax.Array) -> jax.Array:
    """What every router ranks by: its scores rounded to bfloat16 (8 significant bits).

    Tokens with the same input and context (the same byte opening two sequences) have equal
    scores, bit for bit on one layout and an ulp apart on another, where the reduction order
    differs; two experts can score as close for one token. Ranked on exact fp32 values, such
    near-ties go one way here and the other way there. Rounded, near-equal values become equal
    and `top_k` / `argmax` break the tie by index (the lower wins), the same on every layout; a
    flip now needs fp32 noise to straddle a bf16 rounding boundary, about 1e-7 / 4e-3 of the
    time per compared value. The gates stay the exact fp32 scores of the chosen entries.

    The rounding is `reduce_precision`, not a cast to bfloat16 and back: XLA may drop such a pair of
    casts (xla_allow_excess_precision, on by default), and XLA:CPU does inside the fused softmax of
    larger routing batches (a (16, 256, 8) one on jax 0.12), which left the keys exact fp32 there.
    """
    return jax.lax.reduce_precision(scores, exponent_bits=8, mantissa_bits=7)


def expert_choice(logits_GNE: jax.Array, C: int):
    """Expert Choice: each expert takes its top-C tokens of the group, so every expert is exactly
    full and nothing overflows (a token may be taken by several experts or by none; the
    caller measures the unrouted share from the dispatch). It looks at the whole group, so
    it is not causal. Gates are the exact probabilities of the chosen tokens."""
    probs_GEN = jnp.swapaxes(jax.nn.softmax(logits_GNE, axis=-1), 1, 2)
    _, tokens_GEC = jax.lax.top_k(selection_key(probs_GEN), C)
    gates_GEC = jnp.take_along_axis(probs_GEN, tokens_GEC, axis=-1)
    N = logits_GNE.shape[1]
    dispatch_GNEC = jnp.transpose(jax.nn.one_hot(tokens_GEC, N, dtype=jnp.float32), (0, 3, 1, 2))
    combine_GNEC = dispatch_GNEC * gates_GEC[:, None, :, :]
    return Routed(dispatch_GNEC, combine_GNEC, jnp.zeros((), jnp.float32), None, jnp.sum(dispatch_GNEC, axis=(0, 1, 3)))


def z_loss(logits_GNE: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): mean squared log-partition, keeps router logits small."""
    return jnp.mean(jax.nn.logsumexp(logits_GNE, axis=-1) ** 2)
