"""GRPO's objective (train.objective = grpo): Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
Mathematical Reasoning in Open Language Models", eq. 3, with the k3 estimate of the KL divergence to the
reference policy (eq. 4).

A batch holds rl.group_size completions of each prompt, one completion (prompt + completion, the
completion's targets counted) per row, a prompt's group in consecutive rows. On the host, each
completion's reward becomes its group-normalised advantage (`group_advantages`); in the step, each
target's log-probability under the policy, under the weights that sampled the completion (fixed) and
under the reference become per-row losses (`token_terms`) and the step's loss (`batch_objective`), where
it takes the mean cross-entropy for sft. Everything is fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config.rl import RLConfig
from jaxpar.data.packed_rows import PackedRows

# Added to the group's std: a group whose rewards all agree has std 0 (the paper leaves it undefined).
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards_N: np.ndarray, group_size: int) -> np.ndarray:
    """Each completion's advantage (float32, (N,)) from its reward, the rewards laid out as consecutive
    groups of `group_size` completions of one prompt: A = (r - group mean) / (group std + 1e-4), the
    paper's outcome supervision (section 4.1.2).

    The std is the population std (ddof=0), the group's own spread, defined for a group of one (TRL
    takes the Bessel-corrected one, ddof=1, which is a factor sqrt(G / (G - 1)) larger and NaN for
    G = 1). A group with equal rewards gets advantage 0 either way: it says nothing about which
    completion is better."""
    rewards = np.asarray(rewards_N, np.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.size % group_size:
        raise ValueError(f"{rewards.shape} rewards do not split into groups of {group_size}")
    groups_GS = rewards.reshape(-1, group_size)
    mean_G1 = groups_GS.mean(axis=1, keepdims=True)
    std_G1 = groups_GS.std(axis=1, keepdims=True)
    return ((groups_GS - mean_G1) / (std_G1 + np.float32(ADVANTAGE_EPS))).reshape(-1).astype(np.float32)


def _k3(logp_BL: jax.Array, reference_BL: jax.Array) -> jax.Array:
    """The k3 estimate of KL(policy || reference) per token (eq. 4): exp(ref - logp) - (ref - logp) - 1,
    unbiased and never negative (Schulman 2020, "Approximating KL Divergence")."""
    log_ratio_BL = reference_BL - logp_BL
    return jnp.exp(log_ratio_BL) - log_ratio_BL - 1.0


def token_terms(logp_BL: jax.Array, sampled_BL: jax.Array, reference_BL: jax.Array | None, counted_BL: jax.Array,
                advantages_B: jax.Array, clip: float, kl_beta: float) -> dict[str, jax.Array]:
    """Per row (B,) fp32: loss, -(1 / |o|) sum over the completion's counted tokens of
    min(r A, clip(r, 1 - clip, 1 + clip) A) - kl_beta k3, with r = exp(logp - sampled) the ratio to the
    weights that sampled it (fixed, as is the reference); kl, k3's mean over the counted tokens;
    clip_fraction, the share of counted tokens where the clipped term is the smaller (r past
    1 + clip with A > 0, or below 1 - clip with A < 0: their gradient is 0); tokens, |o|. A row with
    no counted token has 0 for each. kl is 0, and k3 not computed, when kl_beta is 0 or there is no
    reference."""
    counted_BL = counted_BL.astype(bool)
    # where, not a product: a target that does not count may hold -inf (a masked token), and -inf * 0 is NaN
    logp_BL = jnp.where(counted_BL, logp_BL.astype(jnp.float32), 0.0)
    sampled_BL = jnp.where(counted_BL, jax.lax.stop_gradient(sampled_BL).astype(jnp.float32), 0.0)
    advantages_B1 = jax.lax.stop_gradient(advantages_B).astype(jnp.float32)[:, None]
    ratio_BL = jnp.exp(logp_BL - sampled_BL)
    clipped_BL = ((advantages_B1 > 0) & (ratio_BL > 1.0 + clip)) | ((advantages_B1 < 0) & (ratio_BL < 1.0 - clip))
    # min(r A, clip(r) A) taken as the branch it picks: where the clipped term wins it is constant in logp
    surrogate_BL = jnp.where(clipped_BL, jnp.clip(ratio_BL, 1.0 - clip, 1.0 + clip), ratio_BL) * advantages_B1
    if kl_beta == 0 or reference_BL is None:
        kl_BL = jnp.zeros_like(logp_BL)
    else:
        reference_BL = jnp.where(counted_BL, jax.lax.stop_gradient(reference_BL).astype(jnp.float32), 0.0)
        kl_BL = _k3(logp_BL, reference_BL)
    objective_BL = surrogate_BL - jnp.float32(kl_beta) * kl_BL
    tokens_B = jnp.sum(counted_BL, axis=1).astype(jnp.float32)
    length_B = jnp.maximum(tokens_B, 1.0)  # the paper's 1 / |o_i|; 1 for a row with none, whose sums are 0

    def row_mean(values_BL):
        return jnp.sum(jnp.where(counted_BL, values_BL, 0.0), axis=1) / length_B

    return {"loss": -row_mean(objective_BL), "kl": row_mean(kl_BL),
            "clip_fraction": row_mean(clipped_BL.astype(jnp.float32)), "tokens": tokens_B}


def batch_objective(cfg: RLConfig, losses_BL: jax.Array, batch: PackedRows) -> tuple[jax.Array, dict]:
    """(the mean GRPO loss over the batch's rows, stats: loss, kl, clip_fraction, each a mean over rows)
    from each target's cross-entropy under the policy (log-probability = -cross-entropy) and the batch's
    sampled_BL, reference_BL and advantages_B. Every row is one completion and each takes the paper's
    1 / |o_i| itself, so the plain means of microbatches and data-parallel shards agree with the whole
    batch's without weights."""
    if batch.segments_BT is None:
        raise ValueError("grpo trains packed rows of prompt + completion with the prompt masked, not plain windows")
    if batch.sampled_BL is None or batch.advantages_B is None:
        raise ValueError("objective grpo needs the sampling weights' log-probabilities and the advantages")
    terms = token_terms(-losses_BL, batch.sampled_BL, batch.reference_BL, batch.target_mask_BL(),
                        batch.advantages_B, cfg.clip, cfg.kl_beta)
    stats = {name: jnp.mean(terms[name]) for name in ("loss", "kl", "clip_fraction")}
    return stats["loss"], stats
