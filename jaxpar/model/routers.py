"""Mixture-of-experts routers: which tokens of a routing group go to which expert slot.

Every router maps router logits (G groups, N tokens, E experts) to a `Routed`:
  dispatch (G, N, E, C): 1 where token n fills slot c of expert e,
  combine  (G, N, E, C): dispatch times the token's gate weight,
the balance loss, the share of assignments dropped for lack of capacity (None for Expert
Choice, which never overflows), each expert's count of assignments chosen before any was
dropped, and the decision as codes (jaxpar.model.routing_trace). Balance losses are computed per
routing group and averaged, so they do not depend on how groups are spread over devices.

Routers rank by the exact fp32 scores, as the open checkpoints' own code does. Given `replay_GNE`
(decision codes another run made: verify's reference replaying its layout), a router takes those
decisions instead of its own, and reports in `Flips` where its own would have differed and by how
much its scores preferred its own choice (the margin).
Shape legend: G groups, N tokens per group, E experts, C capacity (slots per expert per group), K top-k.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.stats import norm


class Flips(NamedTuple):
    """Where a replayed decision differs from the router's own (flipped_GN), and the margin there: the
    gap between the scores of the router's choice and the replayed one, relative to the larger (0
    elsewhere). A near-tie flips by an ulp or so; a bug, by far more."""
    flipped_GN: jax.Array
    margin_GN: jax.Array


class Routed(NamedTuple):
    dispatch: jax.Array  # (G, N, E, C)
    combine: jax.Array  # (G, N, E, C)
    balance: jax.Array  # the auxiliary balance loss (0 for Expert Choice)
    dropped: jax.Array | None  # the share of assignments past capacity (None: Expert Choice)
    chosen_E: jax.Array  # assignments each expert was chosen for, before capacity dropped any
    codes_GNE: jax.Array  # the decision (jaxpar.model.routing_trace)
    flips: Flips | None = None  # replayed: where the router's own decision differs (else None)


def capacity(router: str, group_size: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: capacity_factor x (assignments per group) / E, at least 1."""
    assignments = group_size * (top_k if router == "topk" else 1)
    return max(1, int(math.ceil(capacity_factor * assignments / experts)))


def _positions_in_expert(mask_GNE: jax.Array, already_G1E: jax.Array) -> jax.Array:
    """Slot index each (token, expert) assignment would take: tokens fill in order."""
    return jnp.cumsum(mask_GNE, axis=1) - mask_GNE + already_G1E


def _dispatch_from_choices(choices_GNK, gates_GNK, E: int, C: int):
    """Fill expert slots choice by choice (all first choices before second choices), dropping overflow:
    (dispatch, combine, the dropped share, the decision's codes)."""
    G, N, K = choices_GNK.shape
    dispatch = jnp.zeros((G, N, E, C), jnp.float32)
    combine = jnp.zeros((G, N, E, C), jnp.float32)
    filled_G1E = jnp.zeros((G, 1, E), jnp.float32)
    kept = jnp.zeros((), jnp.float32)
    codes_GNE = jnp.zeros((G, N, E), jnp.float32)
    for k in range(K):
        chosen_GNE = jax.nn.one_hot(choices_GNK[..., k], E, dtype=jnp.float32)
        position_GNE = _positions_in_expert(chosen_GNE, filled_G1E)
        mask_GNE = chosen_GNE * (position_GNE < C)
        slot_GNEC = jax.nn.one_hot(position_GNE.astype(jnp.int32), C, dtype=jnp.float32) * mask_GNE[..., None]
        dispatch = dispatch + slot_GNEC
        combine = combine + slot_GNEC * gates_GNK[..., k, None, None]
        filled_G1E = filled_G1E + jnp.sum(mask_GNE, axis=1, keepdims=True)
        kept = kept + jnp.sum(mask_GNE)
        codes_GNE = codes_GNE + (k + 1) * (2 * mask_GNE - chosen_GNE)  # k + 1 kept, -(k + 1) dropped
    dropped = 1.0 - kept / (G * N * K)
    return dispatch, combine, dropped, codes_GNE


def ranked_codes(choices_GNK: jax.Array, E: int) -> jax.Array:
    """The codes of choices that are all kept (dropless): k + 1 at the k-th choice's expert."""
    ranks_K = jnp.arange(1, choices_GNK.shape[-1] + 1, dtype=jnp.float32)
    return jnp.einsum("GNKE,K->GNE", jax.nn.one_hot(choices_GNK, E, dtype=jnp.float32), ranks_K)


def replayed_choices(codes_GNE: jax.Array, k: int) -> jax.Array:
    """The k ordered choices (G, N, k) that decision codes name."""
    ranks_GNE = jnp.abs(jnp.rint(codes_GNE)).astype(jnp.int32)
    return jnp.stack([jnp.argmax(ranks_GNE == j + 1, axis=-1) for j in range(k)], axis=-1)


def _relative_gap(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.abs(a - b) / jnp.maximum(jnp.maximum(jnp.abs(a), jnp.abs(b)), 1e-30)


def ranked_flips(key_GNE: jax.Array, own_GNK: jax.Array, taken_GNK: jax.Array) -> Flips:
    """Flips of an ordered per-token choice (top-k, Switch): position by position, the relative gap
    between the scores of the expert the router ranks there and the expert replayed there."""
    own, taken = (jnp.take_along_axis(key_GNE, c, axis=-1) for c in (own_GNK, taken_GNK))
    flipped_GN = jnp.any(own_GNK != taken_GNK, axis=-1)
    return Flips(flipped_GN, jnp.where(flipped_GN, jnp.max(_relative_gap(own, taken), axis=-1), 0.0))


def taken_flips(key_GEN: jax.Array, own_GEC: jax.Array, taken_GEC: jax.Array) -> Flips:
    """Flips of each expert's choice of C tokens (Expert Choice): a token in one set and not the other
    flips, and its margin is its expert's largest relative gap between such a token's score and the
    expert's C-th best score."""
    N = key_GEN.shape[-1]
    in_own, in_taken = (jnp.sum(jax.nn.one_hot(t, N, dtype=jnp.int32), axis=-2) > 0 for t in (own_GEC, taken_GEC))
    differs_GEN = in_own != in_taken
    threshold_GE1 = jnp.min(jnp.take_along_axis(key_GEN, own_GEC, axis=-1), axis=-1, keepdims=True)
    margin_GE = jnp.max(jnp.where(differs_GEN, _relative_gap(key_GEN, threshold_GE1), 0.0), axis=-1)
    margin_GN = jnp.max(jnp.where(differs_GEN, margin_GE[..., None], 0.0), axis=1)
    return Flips(jnp.any(differs_GEN, axis=1), margin_GN)


def _cv_squared(x_GE: jax.Array) -> jax.Array:
    """Squared coefficient of variation across experts, averaged over groups."""
    return jnp.mean(jnp.var(x_GE, axis=-1) / (jnp.mean(x_GE, axis=-1) ** 2 + 1e-10))


def switch(logits_GNE: jax.Array, C: int, replay_GNE: jax.Array | None = None):
    """Switch Transformer top-1: capacity C per expert, overflow dropped (the residual carries it).
    Load-balancing loss E * sum_i f_i * P_i (f: fraction routed, P: mean router probability)."""
    E = logits_GNE.shape[-1]
    probs_GNE = jax.nn.softmax(logits_GNE, axis=-1)
    own_GN1 = jnp.argmax(probs_GNE, axis=-1)[..., None]
    choice_GN1 = own_GN1 if replay_GNE is None else replayed_choices(replay_GNE, 1)
    gate_GN1 = jnp.take_along_axis(probs_GNE, choice_GN1, axis=-1)
    dispatch, combine, dropped, codes_GNE = _dispatch_from_choices(choice_GN1, gate_GN1, E, C)
    chosen_GNE = jax.nn.one_hot(choice_GN1[..., 0], E)
    fraction_GE = jnp.mean(chosen_GNE, axis=1)
    balance = E * jnp.mean(jnp.sum(fraction_GE * jnp.mean(probs_GNE, axis=1), axis=-1))
    flips = None if replay_GNE is None else ranked_flips(probs_GNE, own_GN1, choice_GN1)
    return Routed(dispatch, combine, balance, dropped, jnp.sum(chosen_GNE, axis=(0, 1)), codes_GNE, flips)


class Choices(NamedTuple):
    """Top-k's choices before any capacity: each token's k experts and their weights."""
    experts_GNK: jax.Array
    gates_GNK: jax.Array
    load_GE: jax.Array  # the balance loss's load: the smooth estimate under noise, else the counts
    chosen_E: jax.Array
    flips: Flips | None = None  # replayed: where the router's own choices differ (else None)

    def balance(self, importance_GE: jax.Array) -> jax.Array:
        """The auxiliary loss: CV^2 of importance (the gates each expert received) plus CV^2 of load."""
        return _cv_squared(importance_GE) + _cv_squared(self.load_GE)


def topk_choices(logits_GNE: jax.Array, noise_scale_GNE: jax.Array | None, noise_GNE: jax.Array | None,
                 k: int, score: str = "softmax", renormalize: bool = True, bias_E: jax.Array | None = None,
                 replay_GNE: jax.Array | None = None, groups: tuple[int, int] = (1, 1)) -> Choices:
    """Noisy top-k gating (Shazeer et al. 2017): H = logits + N(0,1) * softplus(noise logits); keep
    the top k of H, softmax over them. Auxiliary loss: CV^2 of importance (sum of gates) plus
    CV^2 of load (the smooth probability of each expert being in the top k).

    As open checkpoints define it: scores are the softmax (or the sigmoid, DeepSeek-V3) of H; the
    gates are the chosen experts' scores, scaled to sum to 1 when `renormalize` (Mixtral,
    Qwen3-MoE). bias_E (bias balancing) is added to the scores for choosing alone, not to the gates.
    replay_GNE: decision codes to take instead of the router's own choices (see the module's doc).
    groups (n, m), DeepSeek-V3's group-limited routing: the experts form n equal groups, and a token
    chooses among the experts of the m groups whose two best choosing scores sum highest.
    """
    E = logits_GNE.shape[-1]
    noisy_GNE = logits_GNE
    if noise_GNE is not None:
        stddev_GNE = jax.nn.softplus(noise_scale_GNE) + 1e-2
        noisy_GNE = logits_GNE + noise_GNE * stddev_GNE
    scores_GNE = jax.nn.sigmoid(noisy_GNE) if score == "sigmoid" else jax.nn.softmax(noisy_GNE, axis=-1)
    key_GNE = scores_GNE if bias_E is None else scores_GNE + bias_E
    limited = GroupLimit.of(key_GNE, *groups) if groups[0] > 1 else None
    _, own_GNK = jax.lax.top_k(key_GNE if limited is None else limited.masked(key_GNE), k)
    choices_GNK = own_GNK if replay_GNE is None else replayed_choices(replay_GNE, k)
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
    flips = None
    if replay_GNE is not None:
        flips = (ranked_flips(key_GNE, own_GNK, choices_GNK) if limited is None
                 else limited.flips(key_GNE, own_GNK, choices_GNK))
    return Choices(choices_GNK, gates_GNK, load_GE, jnp.sum(chosen_GE, axis=0), flips)


class GroupLimit(NamedTuple):
    """Group-limited routing's choice of groups: each group's score (the sum of its two best experts'
    choosing scores), and each token's m best groups."""
    score_GNg: jax.Array
    chosen_GNm: jax.Array

    @classmethod
    def of(cls, key_GNE: jax.Array, groups: int, chosen: int) -> GroupLimit:
        G, N, E = key_GNE.shape
        score_GNg = jnp.sum(jax.lax.top_k(key_GNE.reshape(G, N, groups, E // groups), 2)[0], axis=-1)
        return cls(score_GNg, jax.lax.top_k(score_GNg, chosen)[1])

    def group_of(self, experts_GNK: jax.Array, E: int) -> jax.Array:
        return experts_GNK // (E // self.score_GNg.shape[-1])

    def masked(self, key_GNE: jax.Array) -> jax.Array:
        """The choosing scores with the experts of the groups not chosen at -inf."""
        E, groups = key_GNE.shape[-1], self.score_GNg.shape[-1]
        open_GNg = jnp.sum(jax.nn.one_hot(self.chosen_GNm, groups, dtype=jnp.int32), axis=-2) > 0
        return jnp.where(jnp.repeat(open_GNg, E // groups, axis=-1), key_GNE, -jnp.inf)

    def flips(self, key_GNE: jax.Array, own_GNK: jax.Array, taken_GNK: jax.Array) -> Flips:
        """ranked_flips, where a replayed expert outside the token's own groups is judged by its group's
        score against the m-th best group's (the group choice is what flipped), and one inside them by
        its own score against the expert ranked there."""
        taken_group_GNK = self.group_of(taken_GNK, key_GNE.shape[-1])
        inside_GNK = jnp.any(taken_group_GNK[..., None] == self.chosen_GNm[..., None, :], axis=-1)
        threshold_GN1 = jnp.min(jnp.take_along_axis(self.score_GNg, self.chosen_GNm, axis=-1), axis=-1,
                                keepdims=True)
        group_gap_GNK = _relative_gap(jnp.take_along_axis(self.score_GNg, taken_group_GNK, axis=-1), threshold_GN1)
        own, taken = (jnp.take_along_axis(key_GNE, c, axis=-1) for c in (own_GNK, taken_GNK))
        gap_GNK = jnp.where(own_GNK == taken_GNK, 0.0, jnp.where(inside_GNK, _relative_gap(own, taken), group_gap_GNK))
        flipped_GN = jnp.any(own_GNK != taken_GNK, axis=-1)
        return Flips(flipped_GN, jnp.where(flipped_GN, jnp.max(gap_GNK, axis=-1), 0.0))


def noisy_topk(logits_GNE: jax.Array, noise_scale_GNE: jax.Array | None, noise_GNE: jax.Array | None,
               k: int, C: int, score: str = "softmax", renormalize: bool = True,
               bias_E: jax.Array | None = None, replay_GNE: jax.Array | None = None) -> Routed:
    """Top-k's choices (topk_choices) into C slots per expert, overflow dropped."""
    choices = topk_choices(logits_GNE, noise_scale_GNE, noise_GNE, k, score, renormalize, bias_E, replay_GNE)
    return into_slots(choices, logits_GNE.shape[-1], C)


def into_slots(choices: Choices, E: int, C: int) -> Routed:
    """Top-k's choices into C slots per expert (all first choices before second choices), overflow dropped."""
    dispatch, combine, dropped, codes_GNE = _dispatch_from_choices(choices.experts_GNK, choices.gates_GNK, E, C)
    importance_GE = jnp.sum(combine, axis=(1, 3))  # the gates of kept assignments
    return Routed(dispatch, combine, choices.balance(importance_GE), dropped, choices.chosen_E, codes_GNE,
                  choices.flips)


def expert_choice(logits_GNE: jax.Array, C: int, replay_GNE: jax.Array | None = None):
    """Expert Choice: each expert takes its top-C tokens of the group, so every expert is exactly
    full and nothing overflows (a token may be taken by several experts or by none; the
    caller measures the unrouted share from the dispatch). It looks at the whole group, so
    it is not causal. Gates are the exact probabilities of the chosen tokens."""
    probs_GEN = jnp.swapaxes(jax.nn.softmax(logits_GNE, axis=-1), 1, 2)
    _, own_GEC = jax.lax.top_k(probs_GEN, C)
    tokens_GEC = own_GEC
    if replay_GNE is not None:  # the C tokens each expert took (codes 1), lowest index first
        tokens_GEC = jax.lax.top_k((jnp.swapaxes(jnp.abs(replay_GNE), 1, 2) > 0.5).astype(jnp.float32), C)[1]
    gates_GEC = jnp.take_along_axis(probs_GEN, tokens_GEC, axis=-1)
    N = logits_GNE.shape[1]
    dispatch_GNEC = jnp.transpose(jax.nn.one_hot(tokens_GEC, N, dtype=jnp.float32), (0, 3, 1, 2))
    combine_GNEC = dispatch_GNEC * gates_GEC[:, None, :, :]
    codes_GNE = jnp.sum(dispatch_GNEC, axis=-1)
    flips = None if replay_GNE is None else taken_flips(probs_GEN, own_GEC, tokens_GEC)
    return Routed(dispatch_GNEC, combine_GNEC, jnp.zeros((), jnp.float32), None, jnp.sum(dispatch_GNEC, axis=(0, 1, 3)),
                  codes_GNE, flips)


def z_loss(logits_GNE: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): mean squared log-partition, keeps router logits small."""
    return jnp.mean(jax.nn.logsumexp(logits_GNE, axis=-1) ** 2)
