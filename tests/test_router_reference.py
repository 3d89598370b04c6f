"""Each router's vectorised dispatch/combine against a per-token Python loop that shares none of its code.

The loops follow the routers' definitions one token (or one expert) at a time:
- top-k with the noise off: each token's k best experts by probability, the lower expert index
  first among equals, gates the softmax over those k logits; slots are filled
  with every token's first choice in token order, then every token's second choice, and an
  assignment that finds its expert full is dropped;
- Switch: each token's arg-max expert by probability (the lower index among equals), gate its
  softmax probability; slots in token order, overflow dropped;
- Expert Choice: each expert takes the C tokens with the highest probability, the lower token
  index first among equals; gates are the probabilities.
Ties are exact (tokens with bit-identical logits): a near-tie, scores an ulp apart, may rank one way
here and the other way in XLA's softmax, and verify judges such flips by their margin instead
(tests/test_routing_replay.py).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.model import routers

G, S, E = 3, 16, 4  # groups, tokens per group, experts


def _softmax(row: np.ndarray) -> np.ndarray:
    shifted = np.exp(row - row.max())
    return shifted / shifted.sum()


def _capacity(assignments_per_group: int, factor: float) -> int:
    return max(1, math.ceil(factor * assignments_per_group / E))


def _fill_in_order(choices: list[list[tuple[int, float]]], C: int):
    """choices[s] = [(expert, gate), ...] by preference; rank r of every token before rank r + 1."""
    dispatch, combine = np.zeros((S, E, C)), np.zeros((S, E, C))
    filled, kept = [0] * E, 0
    for rank in range(len(choices[0])):
        for s in range(S):
            expert, gate = choices[s][rank]
            if filled[expert] < C:
                dispatch[s, expert, filled[expert]] = 1.0
                combine[s, expert, filled[expert]] = gate
                filled[expert] += 1
                kept += 1
    return dispatch, combine, kept


def topk_loop(logits: np.ndarray, k: int, C: int, score: str = "softmax", renormalize: bool = True,
              bias: np.ndarray | None = None):
    dispatch, combine, kept = [], [], 0
    for group in logits:
        choices = []
        for row in group:
            scores = 1 / (1 + np.exp(-row)) if score == "sigmoid" else _softmax(row)
            keys = scores if bias is None else scores + bias
            best = sorted(range(E), key=lambda e: (-keys[e], e))[:k]
            if score == "softmax" and renormalize:
                gates = _softmax(row[best])
            else:
                gates = scores[best] / (scores[best].sum() if renormalize else 1.0)
            choices.append(list(zip(best, gates)))
        d, c, n = _fill_in_order(choices, C)
        dispatch.append(d), combine.append(c)
        kept += n
    return np.stack(dispatch), np.stack(combine), 1 - kept / (G * S * k)


def switch_loop(logits: np.ndarray, C: int):
    dispatch, combine, kept = [], [], 0
    for group in logits:
        choices = []
        for row in group:
            probs = _softmax(row)
            expert = int(np.argmax(probs))  # the first of equal maxima
            choices.append([(expert, probs[expert])])
        d, c, n = _fill_in_order(choices, C)
        dispatch.append(d), combine.append(c)
        kept += n
    return np.stack(dispatch), np.stack(combine), 1 - kept / (G * S)


def expert_choice_loop(logits: np.ndarray, C: int):
    dispatch, combine = np.zeros((G, S, E, C)), np.zeros((G, S, E, C))
    for g, group in enumerate(logits):
        probs = np.stack([_softmax(row) for row in group])  # (S, E)
        keys = probs
        for e in range(E):
            ranked = sorted(range(S), key=lambda s: (-keys[s, e], s))
            for slot, s in enumerate(ranked[:C]):
                dispatch[g, s, e, slot] = 1.0
                combine[g, s, e, slot] = probs[s, e]
    return dispatch, combine


def _logits(seed: int, ties: str | None) -> np.ndarray:
    """Random router logits; with ties 'exact', the second half of each group repeats the first bit for
    bit, as tokens with equal contexts do, and expert 1 scores every token as expert 0 does."""
    logits = np.random.default_rng(seed).normal(size=(G, S, E)).astype(np.float32)
    if ties == "exact":
        logits[:, S // 2:] = logits[:, : S // 2]
        logits[..., 1] = logits[..., 0]
    return logits


def _close(vectorised, looped):
    np.testing.assert_array_equal(np.asarray(vectorised[0]), looped[0])  # dispatch: exactly the same slots
    np.testing.assert_allclose(np.asarray(vectorised[1]), looped[1], rtol=1e-6, atol=1e-7)  # gates


@pytest.mark.parametrize("seed, ties", [(0, None), (1, "exact"), (4, None)])
@pytest.mark.parametrize("k, factor", [(1, 1.0), (2, 1.25), (2, 0.5)])
def test_topk_without_noise_matches_the_loop(seed, ties, k, factor):
    logits = _logits(seed, ties)
    C = _capacity(S * k, factor)
    assert routers.capacity("topk", S, E, k, factor) == C
    dispatch, combine, _, dropped, *_ = routers.noisy_topk(jnp.asarray(logits), None, None, k, C)
    looped = topk_loop(logits, k, C)
    _close((dispatch, combine), looped)
    assert float(dropped) == pytest.approx(looped[2], abs=1e-6)


@pytest.mark.parametrize("score, renormalize, biased", [("sigmoid", True, False), ("softmax", False, False),
                                                       ("sigmoid", True, True), ("softmax", True, True)])
def test_topk_scores_weights_and_bias_match_the_loop(score, renormalize, biased):
    """Sigmoid scores (DeepSeek-V3), unnormalised weights (Qwen2-MoE), and a bias on the scores that
    moves the choices but not the weights (bias balancing)."""
    logits = _logits(6, None)
    bias = np.linspace(-0.3, 0.3, E).astype(np.float32) if biased else None
    C = _capacity(S * 2, 1.25)
    routed = routers.noisy_topk(jnp.asarray(logits), None, None, 2, C, score, renormalize,
                                None if bias is None else jnp.asarray(bias))
    looped = topk_loop(logits, 2, C, score, renormalize, bias)
    _close((routed.dispatch, routed.combine), looped)
    assert float(routed.dropped) == pytest.approx(looped[2], abs=1e-6)
    if biased:  # the bias changed some choice
        assert not np.array_equal(looped[0], topk_loop(logits, 2, C, score, renormalize)[0])


@pytest.mark.parametrize("seed, ties", [(0, None), (1, "exact"), (4, None)])
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_switch_matches_the_loop_with_capacity_and_drop_order(seed, ties, factor):
    logits = _logits(seed, ties)
    C = _capacity(S, factor)
    assert routers.capacity("switch", S, E, 1, factor) == C
    dispatch, combine, _, dropped, *_ = routers.switch(jnp.asarray(logits), C)
    looped = switch_loop(logits, C)
    _close((dispatch, combine), looped)
    assert float(dropped) == pytest.approx(looped[2], abs=1e-6)
    if factor == 0.5:
        assert looped[2] > 0  # the case exercises dropping


@pytest.mark.parametrize("seed, ties", [(0, None), (1, "exact"), (2, None)])
@pytest.mark.parametrize("factor", [0.5, 1.25])
def test_expert_choice_matches_the_loop(seed, ties, factor):
    logits = _logits(seed, ties)
    C = _capacity(S, factor)
    dispatch, combine, _, dropped, *_ = routers.expert_choice(jnp.asarray(logits), C)
    _close((dispatch, combine), expert_choice_loop(logits, C))
    assert dropped is None  # Expert Choice never overflows; the unrouted share is measured instead


# ---------------------------------------------------------------- the noise and the auxiliary losses, by hand


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _cv2(values: np.ndarray) -> float:
    """The squared coefficient of variation over experts, averaged over groups."""
    return float(np.mean([np.var(v) / (np.mean(v) ** 2 + 1e-10) for v in values]))


def noisy_topk_loop(logits, noise_scale, noise, k: int, C: int):
    """Shazeer et al. 2017 one token at a time: H = x Wg + N(0, 1) softplus(x Wnoise) (plus 1e-2, jaxpar's floor
    on the spread); the k best of softmax(H), gated by the softmax over their H; importance: the kept gates per
    expert; load: each token's P(expert e stays in its top k if e's noise alone were drawn again), the paper's
    eq. 9-10; the balance loss CV^2(importance) + CV^2(load)."""
    dispatch, combine, importance, load = [], [], [], []
    for x, s, n in zip(logits, noise_scale, noise):
        spread = np.log1p(np.exp(s)) + 1e-2
        h = x + n * spread
        choices, group_load = [], np.zeros(E)
        for t in range(S):
            best = sorted(range(E), key=lambda e: (-_softmax(h[t])[e], e))[:k]
            choices.append(list(zip(best, _softmax(h[t][best]))))
            for e in range(E):
                others = sorted((h[t][j] for j in range(E) if j != e), reverse=True)
                group_load[e] += _phi((x[t, e] - others[k - 1]) / spread[t, e])  # beat the k-th best of the rest
        d, c, _ = _fill_in_order(choices, C)
        dispatch.append(d), combine.append(c), importance.append(c.sum(axis=(0, 2))), load.append(group_load)
    return np.stack(dispatch), np.stack(combine), _cv2(np.stack(importance)) + _cv2(np.stack(load))


@pytest.mark.parametrize("k", [1, 2])
def test_noisy_topk_matches_the_papers_gating_and_load_estimator(k):
    rng = np.random.default_rng(7)
    logits, scale, noise = (rng.normal(size=(G, S, E)).astype(np.float32) for _ in range(3))
    C = _capacity(S * k, 1.25)
    dispatch, combine, balance, *_ = routers.noisy_topk(jnp.asarray(logits), jnp.asarray(scale), jnp.asarray(noise),
                                                        k, C)
    looped = noisy_topk_loop(logits, scale, noise, k, C)
    _close((dispatch, combine), looped)
    assert float(balance) == pytest.approx(looped[2], rel=1e-5)


def test_switch_balance_and_z_loss_match_their_definitions():
    """Switch's E sum_i f_i P_i (Fedus et al. 2021, eq. 4) and ST-MoE's z-loss, mean (log sum_j exp x_j)^2."""
    logits = _logits(3, None)
    balance = routers.switch(jnp.asarray(logits), _capacity(S, 1.0))[2]
    expected = []
    for group in logits:
        probs = np.stack([_softmax(row) for row in group])
        fraction = np.bincount(probs.argmax(axis=1), minlength=E) / S
        expected.append(E * np.sum(fraction * probs.mean(axis=0)))
    assert float(balance) == pytest.approx(np.mean(expected), rel=1e-6)
    z = np.mean([np.log(np.exp(row.astype(np.float64)).sum()) ** 2 for group in logits for row in group])
    assert float(routers.z_loss(jnp.asarray(logits))) == pytest.approx(z, rel=1e-6)
