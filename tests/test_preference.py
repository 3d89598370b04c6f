"""jaxpar.train.preference against an independent implementation: Python loops over rows and documents,
float64, each objective written from its paper, starting from per-token log-probabilities and masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config.preference import PreferenceConfig
from jaxpar.train.preference import pair_log_probs, pair_metrics, preference_losses

CASES = [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "hinge"), ("simpo", "sigmoid"), ("orpo", "sigmoid")]


def _packed_rows(rng, rows: int, T: int, pad_rows=()):
    """Rows of whole pairs, (chosen document, rejected document), each its prompt then its response,
    then a padding document. Prompts 1-4 tokens, responses 0-6 (0: a pair that is not valid). Returns
    per target (L = T - 1): counted (a response token of its input's document) and its document."""
    segments_BT = np.zeros((rows, T), np.int32)
    response_BT = np.zeros((rows, T), bool)
    for b in range(rows):
        pos, doc = 0, 0
        while b not in pad_rows:
            prompt = int(rng.integers(1, 5))
            answers = [int(rng.integers(0, 7)) if rng.random() < 0.15 else int(rng.integers(1, 7)) for _ in range(2)]
            if pos + 2 * prompt + sum(answers) > T:
                break
            for answer in answers:  # chosen, then rejected
                segments_BT[b, pos:pos + prompt + answer] = doc
                response_BT[b, pos + prompt:pos + prompt + answer] = True
                pos, doc = pos + prompt + answer, doc + 1
        segments_BT[b, pos:] = doc  # the padding document (none when the pairs fill the row)
    counted_BL = response_BT[:, 1:] & (segments_BT[:, 1:] == segments_BT[:, :-1])
    return counted_BL, segments_BT[:, 1:]


def _log_probs(rng, counted_BL, doc_BL):
    """Policy log-probs (<= 0; -inf at the padding document's targets, which count for nothing) and the
    reference's, near the policy's."""
    logp_BL = -rng.exponential(1.0, counted_BL.shape)
    last_doc_B1 = doc_BL.max(axis=1, keepdims=True)
    logp_BL[(doc_BL == last_doc_B1) & (last_doc_B1 % 2 == 0)] = -np.inf
    return logp_BL, logp_BL + 0.3 * rng.standard_normal(counted_BL.shape)


def _pairs(counted_BL, doc_BL):
    """(row, chosen targets, rejected targets) of every pair with both responses counted, the targets as
    (L,) masks: loops."""
    found = []
    B, L = counted_BL.shape
    for b in range(B):
        for d in range(0, int(doc_BL[b].max()) + 1, 2):
            chosen = np.array([bool(counted_BL[b, j] and doc_BL[b, j] == d) for j in range(L)])
            rejected = np.array([bool(counted_BL[b, j] and doc_BL[b, j] == d + 1) for j in range(L)])
            if chosen.any() and rejected.any():
                found.append((b, chosen, rejected))
    return found


def _expected(objective, cfg, logp_BL, ref_BL, pairs):
    """(the mean loss over the pairs, the metrics, with ORPO's mean NLL): each pair's loss from its
    paper's formula."""
    losses, rewards, nlls = [], [], []
    for b, chosen, rejected in pairs:
        pc, pr = jnp.sum(jnp.where(chosen, logp_BL[b], 0.0)), jnp.sum(jnp.where(rejected, logp_BL[b], 0.0))
        rc, rr = jnp.sum(jnp.where(chosen, ref_BL[b], 0.0)), jnp.sum(jnp.where(rejected, ref_BL[b], 0.0))
        if objective == "dpo":  # Rafailov et al. 2023 eq. 7; IPO: Azar et al. 2023 eq. 17; SLiC's hinge
            h = (pc - rc) - (pr - rr)
            loss = {"sigmoid": -jnp.log(1 / (1 + jnp.exp(-cfg.beta * h))),
                    "ipo": (h - 1 / (2 * cfg.beta)) ** 2,
                    "hinge": jnp.maximum(0.0, 1 - cfg.beta * h)}[cfg.loss]
            reward = (cfg.beta * (pc - rc), cfg.beta * (pr - rr))
        elif objective == "simpo":  # Meng et al. 2024 eq. 6
            reward = (cfg.beta * pc / chosen.sum(), cfg.beta * pr / rejected.sum())
            loss = -jnp.log(1 / (1 + jnp.exp(-(reward[0] - reward[1] - cfg.gamma))))
        else:  # ORPO, Hong et al. 2024 eqs. 2-7: odds = P / (1 - P), P = exp(mean log-prob)
            mc, mr = pc / chosen.sum(), pr / rejected.sum()
            odds_c, odds_r = jnp.exp(mc) / (1 - jnp.exp(mc)), jnp.exp(mr) / (1 - jnp.exp(mr))
            loss = -mc - cfg.beta * jnp.log(1 / (1 + (odds_r / odds_c)))
            reward = (cfg.beta * mc, cfg.beta * mr)
            nlls.append(-mc)
        losses.append(loss)
        rewards.append(reward)
    chosen_rewards = jnp.stack([r[0] for r in rewards])
    rejected_rewards = jnp.stack([r[1] for r in rewards])
    metrics = {"rewards/chosen": jnp.mean(chosen_rewards), "rewards/rejected": jnp.mean(rejected_rewards),
               "margin": jnp.mean(chosen_rewards - rejected_rewards),
               "accuracy": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float64))}
    if nlls:
        metrics["nll"] = jnp.mean(jnp.stack(nlls))
    return jnp.mean(jnp.stack(losses)), metrics


def _under_test(objective, cfg, logp_BL, ref_BL, counted_BL, doc_BL, pairs):
    policy = pair_log_probs(logp_BL, counted_BL, doc_BL, pairs)
    reference = pair_log_probs(ref_BL, counted_BL, doc_BL, pairs) if objective == "dpo" else None
    losses = preference_losses(objective, cfg, policy, reference)
    return jnp.sum(losses["loss"]) / jnp.sum(policy.valid), pair_metrics(losses, policy.valid)


def _loss_and_grad(fn, logp_BL):
    """((loss, metrics), d loss / d logp_BL) of fn(logp_BL) -> (loss, metrics), as one compiled program: op
    by op, the many small programs take seconds to compile."""
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(logp_BL)


def _check(objective, cfg, logp, ref, counted_BL, doc_BL, pairs):
    ref32 = jnp.asarray(ref, jnp.float32)
    (loss, metrics), grad = _loss_and_grad(
        lambda logp_BL: _under_test(objective, cfg, logp_BL, ref32, counted_BL, doc_BL, pairs),
        jnp.asarray(logp, jnp.float32))
    with jax.enable_x64(True):
        found = _pairs(counted_BL, doc_BL)
        ref64 = jnp.asarray(ref, jnp.float64)
        (want, want_metrics), want_grad = _loss_and_grad(
            lambda logp_BL: _expected(objective, cfg, logp_BL, ref64, found), jnp.asarray(logp, jnp.float64))
        want, want_grad = np.asarray(want), np.asarray(want_grad)
        want_metrics = {k: np.asarray(v) for k, v in want_metrics.items()}
    assert loss.dtype == grad.dtype == jnp.float32
    np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-6, err_msg=name)
    return loss, grad, metrics


@pytest.mark.parametrize("objective,loss", CASES)
def test_losses_gradients_and_metrics_match_the_papers(objective, loss):
    """4 rows of 40 targets: several pairs a row, uneven prompts and responses, pairs with an empty
    response, padding, and row 2 only padding; pairs = T // 2 slots. Mean loss over the valid pairs, its
    gradient with respect to the policy's log-probs, and the metrics, all within 1e-6 of the float64 loops
    (which see no pair in row 2); row 2's gradient is 0."""
    rng = np.random.default_rng(7)
    counted_BL, doc_BL = _packed_rows(rng, 4, 41, pad_rows=(2,))
    found = _pairs(counted_BL, doc_BL)
    slots = sum(int(doc_BL[b].max()) // 2 + 1 for b in range(4))
    assert len(found) >= 6 and slots > len(found) + 1  # several valid pairs, and slots that are not
    logp, ref = _log_probs(rng, counted_BL, doc_BL)
    cfg = PreferenceConfig(beta=0.1, loss=loss, gamma=0.5)
    _, grad, _ = _check(objective, cfg, logp, ref, counted_BL, doc_BL, pairs=41 // 2)
    assert not counted_BL[2].any() and np.all(grad[2] == 0)
    policy = pair_log_probs(jnp.asarray(logp, jnp.float32), counted_BL, doc_BL, 41 // 2)
    assert not policy.valid[2].any() and np.all(policy.chosen[2] == 0) and np.all(policy.rejected[2] == 0)


def test_documents_past_the_pairs_kept_are_ignored():
    """pairs=1 keeps each row's first pair, identical to the first slot of pairs=20: the later documents
    neither raise nor leak into the next row's slots."""
    rng = np.random.default_rng(5)
    counted_BL, doc_BL = _packed_rows(rng, 3, 41)
    logp, _ = _log_probs(rng, counted_BL, doc_BL)
    few = pair_log_probs(jnp.asarray(logp, jnp.float32), counted_BL, doc_BL, 1)
    many = pair_log_probs(jnp.asarray(logp, jnp.float32), counted_BL, doc_BL, 20)
    for a, b in zip(jax.tree.leaves(few), jax.tree.leaves(many)):
        assert a.shape == (3, 1)
        np.testing.assert_array_equal(a, b[:, :1])


def test_orpo_stays_finite_at_a_mean_log_prob_near_zero():
    """A model certain of its responses (log-probs 0, or within fp32's reach of it) gives a finite ORPO
    loss, gradient and metrics, where log(1 - exp(0)) alone is -inf. One pair a row: each chosen value
    against the same rejected one and against -1."""
    rows = [(value, rejected) for value in (0.0, -1e-9, -1e-7) for rejected in (value, -1.0)]
    counted_BL = np.tile([False, True, True, False, True, True, False], (len(rows), 1))
    doc_BL = np.tile([0, 0, 0, 1, 1, 1, 2], (len(rows), 1))
    logp_BL = np.array([[0.0, value, value, 0.0, rejected, rejected, 0.0] for value, rejected in rows])
    (loss, metrics), grad = _loss_and_grad(
        lambda logp_BL: _under_test("orpo", PreferenceConfig(), logp_BL, None, counted_BL, doc_BL, 3),
        jnp.asarray(logp_BL, jnp.float32))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert all(np.isfinite(value) for value in metrics.values())
    policy = pair_log_probs(jnp.asarray(logp_BL, jnp.float32), counted_BL, doc_BL, 3)
    per_pair = preference_losses("orpo", PreferenceConfig(), policy, None)
    assert all(np.all(np.isfinite(value)) for value in per_pair.values())
