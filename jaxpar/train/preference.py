"""Preference objectives (train.objective = dpo, simpo or orpo) on packed rows of whole pairs.

A row holds pairs one after another, each as two documents: first the chosen one (prompt + chosen
response), then the rejected one (prompt + rejected response). Document d of a row is then the chosen
(d even) or rejected (d odd) half of the row's pair d // 2. The step gives per target the policy's
log-probability, whether it counts (a response token of its input's document) and its document; here
they become per-pair sums (`pair_log_probs`), per-pair losses and rewards (`preference_losses`) and
scalar metrics over the valid pairs (`pair_metrics`). Everything is fp32.

In the train step (jaxpar.train.step): `weighted_pairs` weights each row from the whole batch, so that the
plain means over the rows of microbatches and data-parallel shards average to the mean over the batch's
valid pairs; DPO's reference log-probabilities come from the same model with every adapter's B zeroed
(jaxpar.model.adapters.without_adapters), computed before the gradient and carried in the batch;
`batch_objective` is then what the step reduces each target's cross-entropy to, where it takes the
mean cross-entropy for sft.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.config.preference import PreferenceConfig
from jaxpar.data.packed_rows import PackedRows

# ORPO's largest mean log-probability: log(1 - exp(a)) is -inf at a = 0 (a response the model is certain
# of, which fp32's log_softmax does give), and its gradient 1 / |a| unbounded near it.
ORPO_MAX_MEAN_LOGP = -1e-6


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairLogProbs:
    """Per pair (B rows, P pairs a row): the summed log-probabilities of the chosen and rejected
    responses' counted targets, and how many targets each has (float32)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array

    @property
    def valid(self) -> jax.Array:
        """(B, P) bools: a real pair, both responses with a counted target (padding, a slot past the
        row's last pair, or a response truncated to nothing is not)."""
        return (self.chosen_tokens > 0) & (self.rejected_tokens > 0)


def pair_log_probs(logp_BL: jax.Array, counted_BL: jax.Array, doc_BL: jax.Array, pairs: int) -> PairLogProbs:
    """Sum the counted targets' log-probabilities by (row, document), then split documents into pairs.

    A segment_sum per row over its document ids: memory O(B L), where a one-hot over pairs would be
    O(B L P) (L may be 8192), and row by row, so that a batch split over devices by rows is summed
    where it lies (one flat sum over all rows' segments is not: in a pipeline's last-stage branch the
    collectives the partitioner adds to reshard it wait for stages that never come). Targets of
    documents past the 2 * pairs kept (or with a negative id) go to a spare segment that is dropped."""
    docs = 2 * pairs
    counted_BL = counted_BL.astype(bool)
    in_range_BL = (doc_BL >= 0) & (doc_BL < docs)
    ids_BL = jnp.where(in_range_BL, doc_BL.astype(jnp.int32), docs)
    # where, not a product: a target that does not count may hold -inf (a masked token), and -inf * 0 is NaN
    values_BL2 = jnp.stack([jnp.where(counted_BL, logp_BL.astype(jnp.float32), 0.0),
                            counted_BL.astype(jnp.float32)], axis=-1)
    per_row = jax.vmap(lambda values_L2, ids_L: jax.ops.segment_sum(values_L2, ids_L, num_segments=docs + 1))
    sums_BP22 = per_row(values_BL2, ids_BL)[:, :-1].reshape(-1, pairs, 2, 2)  # (row, pair, chosen/rejected, sum/count)
    return PairLogProbs(chosen=sums_BP22[:, :, 0, 0], rejected=sums_BP22[:, :, 1, 0],
                        chosen_tokens=sums_BP22[:, :, 0, 1], rejected_tokens=sums_BP22[:, :, 1, 1])


def _mean_log_probs(policy: PairLogProbs) -> tuple[jax.Array, jax.Array]:
    """The length-normalised log-probabilities (SimPO's and ORPO's); a count of 0 (an invalid pair) is
    taken as 1 so that no NaN reaches the gradient through the masked branch."""
    return (policy.chosen / jnp.maximum(policy.chosen_tokens, 1.0),
            policy.rejected / jnp.maximum(policy.rejected_tokens, 1.0))


def _log1m_exp(a: jax.Array) -> jax.Array:
    """log(1 - exp(a)) for a < 0, accurate at both ends (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))"): log(-expm1(a)) near 0, where fp32's 1 - exp(a) loses its digits, and
    log1p(-exp(a)) below -log 2. a is clamped to ORPO_MAX_MEAN_LOGP first, so a -> 0 stays finite."""
    a = jnp.minimum(a, ORPO_MAX_MEAN_LOGP)
    return jnp.where(a > -jnp.log(2.0), jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def _dpo(cfg: PreferenceConfig, policy: PairLogProbs, reference: PairLogProbs | None) -> dict[str, jax.Array]:
    """DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7) on the summed log-ratios
    h = (pc - rc) - (pr - rr). loss: sigmoid, the paper's -log sigmoid(beta h); ipo (Azar et al. 2023,
    "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17, on summed
    log-probs as TRL does) (h - 1 / (2 beta))^2; hinge (SLiC, Zhao et al. 2023) relu(1 - beta h).
    Rewards: the implicit rewards beta (p - r) of each response."""
    if reference is None:
        raise ValueError("objective dpo needs the reference model's log-probabilities")
    ratio_chosen = policy.chosen - reference.chosen
    ratio_rejected = policy.rejected - reference.rejected
    h = ratio_chosen - ratio_rejected
    if cfg.loss == "sigmoid":
        loss = -jax.nn.log_sigmoid(cfg.beta * h)
    elif cfg.loss == "ipo":
        loss = (h - 1.0 / (2.0 * cfg.beta)) ** 2
    elif cfg.loss == "hinge":
        loss = jax.nn.relu(1.0 - cfg.beta * h)
    else:
        raise ValueError(f"unknown preference loss {cfg.loss!r} (sigmoid, ipo or hinge)")
    return {"loss": loss, "reward_chosen": cfg.beta * ratio_chosen, "reward_rejected": cfg.beta * ratio_rejected}


def _simpo(cfg: PreferenceConfig, policy: PairLogProbs) -> dict[str, jax.Array]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    eq. 6): no reference, the reward is beta times the mean log-probability, and the chosen one must
    beat the rejected one by the margin gamma: -log sigmoid(beta a_c - beta a_r - gamma)."""
    mean_chosen, mean_rejected = _mean_log_probs(policy)
    reward_chosen, reward_rejected = cfg.beta * mean_chosen, cfg.beta * mean_rejected
    loss = -jax.nn.log_sigmoid(reward_chosen - reward_rejected - cfg.gamma)
    return {"loss": loss, "reward_chosen": reward_chosen, "reward_rejected": reward_rejected}


def _orpo(cfg: PreferenceConfig, policy: PairLogProbs) -> dict[str, jax.Array]:
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
    eqs. 2-7): P(y|x) = exp(a), a the mean log-probability; odds(y) = P / (1 - P); the loss is the chosen
    response's mean NLL plus beta (the paper's lambda) times -log sigmoid(log odds_c - log odds_r).
    Rewards: beta a, as TRL reports them."""
    mean_chosen, mean_rejected = _mean_log_probs(policy)
    log_odds = (mean_chosen - _log1m_exp(mean_chosen)) - (mean_rejected - _log1m_exp(mean_rejected))
    nll = -mean_chosen
    loss = nll - cfg.beta * jax.nn.log_sigmoid(log_odds)
    return {"loss": loss, "reward_chosen": cfg.beta * mean_chosen, "reward_rejected": cfg.beta * mean_rejected,
            "nll": nll}


# Each preference objective's per-pair terms from (settings, the policy's sums, the reference's sums or None).
PAIR_LOSSES = {
    "dpo": _dpo,
    "simpo": lambda cfg, policy, reference: _simpo(cfg, policy),  # reference-free
    "orpo": lambda cfg, policy, reference: _orpo(cfg, policy),  # reference-free
}


def preference_losses(objective: str, cfg: PreferenceConfig, policy: PairLogProbs,
                      reference: PairLogProbs | None) -> dict[str, jax.Array]:
    """Per-pair (B, P) fp32 arrays: loss, reward_chosen, reward_rejected (and nll for orpo), each 0
    where the pair is not valid, so that a sum over pairs divided by the valid count is the mean.
    reference: the reference model's sums, needed by dpo only (simpo and orpo are reference-free)."""
    out = PAIR_LOSSES[objective](cfg, policy, reference)
    valid = policy.valid
    return {name: jnp.where(valid, value.astype(jnp.float32), 0.0) for name, value in out.items()}


def _pair_terms(losses: dict[str, jax.Array], valid: jax.Array) -> dict[str, jax.Array]:
    """Per pair (B, P), 0 where the pair is not valid: rewards/chosen, rewards/rejected, margin (chosen -
    rejected), accuracy (1 where the chosen reward is the higher), and nll when the objective has one."""
    valid = valid.astype(bool)
    chosen, rejected = losses["reward_chosen"], losses["reward_rejected"]
    terms = {"rewards/chosen": chosen, "rewards/rejected": rejected, "margin": chosen - rejected,
             "accuracy": (chosen > rejected).astype(jnp.float32)}
    if "nll" in losses:
        terms["nll"] = losses["nll"]
    return {name: jnp.where(valid, value, 0.0) for name, value in terms.items()}


def pair_metrics(losses: dict[str, jax.Array], valid: jax.Array) -> dict[str, jax.Array]:
    """Scalars averaged over the valid pairs (0 when there are none): rewards/chosen, rewards/rejected,
    margin (chosen - rejected), accuracy (the share whose chosen reward is the higher), and nll when
    the objective has one (orpo)."""
    count = jnp.maximum(jnp.sum(valid.astype(bool)), 1).astype(jnp.float32)
    return {name: jnp.sum(value) / count for name, value in _pair_terms(losses, valid).items()}


# ---- in the train step ----------------------------------------------------------------------------

def _pair_sums(logp_BL: jax.Array, batch: PackedRows) -> PairLogProbs:
    """pair_log_probs of per-target log-probabilities (in the targets' order) of preference rows: the
    counted targets, their documents, and T // 2 pairs a row (the most a row of T tokens can hold)."""
    if batch.segments_BT is None:
        raise ValueError("a preference objective trains packed rows of pairs (documents chosen, rejected), "
                         "not plain windows")
    return pair_log_probs(logp_BL, batch.target_mask_BL(), batch.target_documents_BL(), batch.tokens_BT.shape[1] // 2)


def weighted_pairs(batch: PackedRows) -> PackedRows:
    """The batch with every row weighted by (rows / valid pairs), counted on the whole batch: the plain
    mean over rows of a row's summed pair terms times its weight is then the mean over the valid pairs,
    and microbatches and data-parallel shards, each taking a plain mean over its rows, agree."""
    valid = _pair_sums(jnp.zeros(batch.targets_BL.shape, jnp.float32), batch).valid
    rows = batch.tokens_BT.shape[0]
    weight = rows / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    return dataclasses.replace(batch, pair_weights_B=jnp.full((rows,), weight, jnp.float32))


def batch_objective(objective: str, cfg: PreferenceConfig, losses_BL: jax.Array,
                    batch: PackedRows) -> tuple[jax.Array, dict]:
    """(the mean preference loss over the batch's valid pairs, stats: 'loss' and the pair metrics) from
    each target's cross-entropy under the policy (log-probability = -cross-entropy) and, for dpo, the
    reference's log-probabilities in the batch (reference_BL). Rows weighted by `weighted_pairs`: a
    microbatch's or shard's value is its share, averaging to the whole batch's."""
    policy = _pair_sums(-losses_BL, batch)
    reference = None if batch.reference_BL is None else _pair_sums(batch.reference_BL, batch)
    losses = preference_losses(objective, cfg, policy, reference)
    terms = {"loss": losses["loss"], **_pair_terms(losses, policy.valid)}
    stats = {name: jnp.mean(jnp.sum(value, axis=1) * batch.pair_weights_B) for name, value in terms.items()}
    return stats["loss"], stats
