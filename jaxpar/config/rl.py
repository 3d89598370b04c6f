"""The rl section: reinforcement learning from verifiable rewards (train.objective=grpo; the loss in
jaxpar.rl.grpo, the rewards in jaxpar.rl.rewards, the rollouts in jaxpar.rl.rollout)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """group_size: completions sampled per prompt (train.batch_size rows a step: batch_size / group_size
    prompts). reward: a built-in (exact_match: the completion's first line equals the prompt record's
    `answer_field`; regex: re.search(pattern) finds a match; length: 1 - |characters - target_length| /
    target_length, at least 0) or `module:function`, a callable (prompt, completion[, record fields it
    names]) -> float. clip: the ratio's clip range epsilon; kl_beta: the weight of the k3 KL estimate to
    the reference policy (0: none). updates_per_batch: optimizer steps on each sampled batch.
    max_new_tokens, temperature, top_k (0: all), top_p (1: all): how completions are sampled."""
    group_size: int = 4
    reward: str = "exact_match"
    answer_field: str = "answer"
    pattern: str = ""
    target_length: int = 0
    clip: float = 0.2
    kl_beta: float = 0.04
    updates_per_batch: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
