"""jaxpar.rl.grpo against an independent implementation written from the paper (Shao et al. 2024,
eqs. 3 and 4): a Python loop over rows, each row's counted tokens picked out by index, the surrogate as
min(r A, clip(r) A), on random log-probabilities, masks and advantages; the loss and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config.rl import RLConfig
from jaxpar.data.packed_rows import PackedRows
from jaxpar.rl.grpo import batch_objective, group_advantages, token_terms

B, L = 6, 7


def _case(seed: int, spread: float):
    """Per target: policy log-probs (-inf where a target does not count, as a masked token may be), the
    sampling weights' (the policy's plus noise of `spread`: far from 1 the ratio clips), the reference's,
    which targets count (the last row none), and per row an advantage (one 0)."""
    rng = np.random.default_rng(seed)
    counted = rng.random((B, L)) < 0.7
    counted[0, 0] = True
    counted[-1] = False
    logp = -rng.exponential(1.0, (B, L)).astype(np.float32)
    sampled = (logp + spread * rng.standard_normal((B, L))).astype(np.float32)
    reference = (logp + 0.3 * rng.standard_normal((B, L))).astype(np.float32)
    logp[~counted & (rng.random((B, L)) < 0.5)] = -np.inf
    advantages = rng.standard_normal(B).astype(np.float32)
    advantages[1] = 0.0
    return logp, sampled, reference, counted, advantages


def _paper(logp, sampled, reference, counted, advantages, clip, kl_beta):
    """Per row: -(1/|o|) sum_t [min(r A, clip(r, 1-e, 1+e) A) - beta k3], k3 = exp(ref - logp) - (ref -
    logp) - 1, r = exp(logp - sampled); and the share of tokens where the clipped term is the smaller.
    Rows with no counted token: 0."""
    losses, clipped = [], []
    for b in range(B):
        index = np.flatnonzero(counted[b])
        if index.size == 0:
            losses.append(jnp.float32(0.0))
            clipped.append(jnp.float32(0.0))
            continue
        ratio = jnp.exp(logp[b, index] - sampled[b, index])
        unclipped, clipped_term = ratio * advantages[b], jnp.clip(ratio, 1 - clip, 1 + clip) * advantages[b]
        objective = jnp.minimum(unclipped, clipped_term)
        if kl_beta and reference is not None:
            log_ratio = reference[b, index] - logp[b, index]
            objective = objective - kl_beta * (jnp.exp(log_ratio) - log_ratio - 1)
        losses.append(-jnp.sum(objective) / index.size)
        clipped.append(jnp.mean((clipped_term < unclipped).astype(jnp.float32)))
    return jnp.stack(losses), jnp.stack(clipped)


def _rows(counted, sampled, reference, advantages) -> PackedRows:
    """Packed rows of one document each whose targets count where `counted` says (mask_BT[:, 1:])."""
    mask = np.concatenate([np.zeros((counted.shape[0], 1), bool), counted], axis=1).astype(np.int32)
    tokens = np.ones(mask.shape, np.int32)
    return PackedRows(tokens, segments_BT=np.zeros_like(tokens), positions_BT=np.broadcast_to(
        np.arange(tokens.shape[1]), tokens.shape), mask_BT=mask, reference_BL=None if reference is None
        else jnp.asarray(reference), sampled_BL=jnp.asarray(sampled), advantages_B=jnp.asarray(advantages))


CASES = [(0.05, 0.04, True), (1.5, 0.04, True), (1.5, 0.0, True), (0.8, 0.1, False)]


@pytest.mark.parametrize("spread, kl_beta, with_reference", CASES)
def test_the_loss_and_its_gradient_are_the_papers(spread, kl_beta, with_reference):
    logp, sampled, reference, counted, advantages = _case(int(spread * 10) + int(kl_beta * 100), spread)
    reference = reference if with_reference else None
    cfg = RLConfig(clip=0.2, kl_beta=kl_beta)
    batch = _rows(counted, sampled, reference, advantages)

    def ours(logp_BL):
        return batch_objective(cfg, -logp_BL, batch)

    def paper(logp_BL):
        return jnp.mean(_paper(logp_BL, sampled, reference, counted, advantages, cfg.clip, kl_beta)[0])

    # jitted: one compile each, where op-by-op dispatch compiles every loop step's ops
    (loss, stats), grad = jax.jit(jax.value_and_grad(ours, has_aux=True))(jnp.asarray(logp))
    expected_loss, expected_grad = jax.jit(jax.value_and_grad(paper))(jnp.asarray(logp))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-6)
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[~counted].any()
    _, clipped = _paper(logp, sampled, reference, counted, advantages, cfg.clip, kl_beta)
    np.testing.assert_allclose(stats["clip_fraction"], clipped.mean(), rtol=1e-6)
    if spread > 1:
        assert clipped.max() > 0  # the case exercises the clipped branch
    assert all(value.dtype == jnp.float32 and value.shape == () for value in stats.values())


def test_the_per_row_terms():
    logp, sampled, reference, counted, advantages = _case(3, 1.0)
    terms = jax.jit(token_terms, static_argnums=(5, 6))(logp, sampled, reference, counted, advantages, 0.2, 0.04)
    losses, clipped = _paper(logp, sampled, reference, counted, advantages, 0.2, 0.04)
    np.testing.assert_allclose(terms["loss"], losses, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(terms["clip_fraction"], clipped, rtol=1e-6)
    np.testing.assert_array_equal(terms["tokens"], counted.sum(axis=1))
    for b in range(B - 1):
        index = np.flatnonzero(counted[b])
        log_ratio = reference[b, index] - logp[b, index]
        np.testing.assert_allclose(terms["kl"][b], np.mean(np.exp(log_ratio) - log_ratio - 1), rtol=1e-5)
    assert terms["loss"][-1] == terms["kl"][-1] == terms["clip_fraction"][-1] == terms["tokens"][-1] == 0
    no_kl = token_terms(logp, sampled, reference, counted, advantages, 0.2, 0.0)
    assert not np.asarray(no_kl["kl"]).any()


@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
def test_the_first_update_is_the_plain_policy_gradient(kl_beta):
    """At logp == sampled the ratio is 1 (nothing clips) and, with the reference at the policy, k3's gradient
    is 0: the gradient is -A / |o| on every counted target."""
    logp, _, _, counted, advantages = _case(5, 0.0)
    batch = _rows(counted, logp, logp, advantages)
    grad = jax.grad(lambda x: batch_objective(RLConfig(kl_beta=kl_beta), -x, batch)[0])(jnp.asarray(logp))
    tokens = np.maximum(counted.sum(axis=1, keepdims=True), 1)
    expected = np.where(counted, -advantages[:, None] / tokens, 0.0) / B  # the mean over the batch's rows
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7)


def test_microbatches_agree_with_the_whole_batch():
    logp, sampled, reference, counted, advantages = _case(7, 1.0)
    cfg = RLConfig(kl_beta=0.04)
    objective = jax.jit(lambda losses, batch: batch_objective(cfg, losses, batch))
    whole, whole_stats = objective(-logp, _rows(counted, sampled, reference, advantages))
    halves = [objective(-logp[part], _rows(counted[part], sampled[part], reference[part],
                                                      advantages[part]))
              for part in (slice(0, B // 2), slice(B // 2, B))]
    np.testing.assert_allclose((halves[0][0] + halves[1][0]) / 2, whole, rtol=1e-6)
    for name in whole_stats:
        np.testing.assert_allclose((halves[0][1][name] + halves[1][1][name]) / 2, whole_stats[name], rtol=1e-6)


def test_group_advantages():
    rewards = np.array([0, 1, 1, 0, 2, 2, 2, 2, 0.5, 3, -1, 7], np.float32)
    advantages = group_advantages(rewards, 4)
    assert advantages.dtype == np.float32 and advantages.shape == (12,)
    groups = advantages.reshape(3, 4)
    np.testing.assert_allclose(groups.mean(axis=1), 0, atol=1e-6)
    assert not groups[1].any()  # equal rewards: no preference, advantage 0
    np.testing.assert_allclose(groups[0], np.array([-0.5, 0.5, 0.5, -0.5]) / (0.5 + 1e-4), rtol=1e-6)
    third = rewards[8:]
    np.testing.assert_allclose(groups[2], (third - third.mean()) / (third.std() + 1e-4), rtol=1e-6)
    assert not group_advantages(np.array([3.0, 5.0]), 1).any()  # a group of one: std 0, advantage 0
    with pytest.raises(ValueError):
        group_advantages(rewards, 5)
