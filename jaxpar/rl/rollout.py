"""GRPO's batches: completions sampled from the current weights, scored, and laid out as training rows.

A rollout takes batch_size / group_size prompts (jaxpar.rl.prompts), samples group_size completions of
each with the training state's own weights on the training mesh (jaxpar.sampling.batched: no copy),
scores them (jaxpar.rl.rewards) and normalises each reward against its group's (the advantage). Each
completion becomes one row: prompt, completion, then padding (a document of its own), with the loss
counting the completion's tokens alone.

`Scoring` then adds, on the devices, what the objective compares the policy with: each target's
log-probability under the weights that sampled it (computed once, so that rl.updates_per_batch > 1
steps measure how far they have moved) and under the reference policy (the model with its adapters
off, or a frozen copy of the starting weights).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxpar.data.packed_rows import PackedRows
from jaxpar.data.token_folder import TextCodec
from jaxpar.laid_out.forward import target_losses
from jaxpar.laid_out.model import LaidOutModel
from jaxpar.model.adapters import without_adapters
from jaxpar.model.axes import layout_hooks
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.rl.grpo import group_advantages
from jaxpar.rl.prompts import PromptSet
from jaxpar.rl.rewards import Reward, score_all
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.sampling.prompts import PROMPT_FIELD


@dataclasses.dataclass(frozen=True)
class Rollout:
    """rows: the host batch (PackedRows of NumPy arrays, advantages set); metrics: reward_mean,
    reward_std, completion_tokens (the mean), generate_s (sampling's seconds)."""

    rows: PackedRows
    metrics: dict


def training_rows(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray,
                  width: int) -> PackedRows:
    """One row of `width` tokens per completion: its prompt, itself, then padding (document 1); the loss
    mask is 1 on the completion's tokens."""
    B = len(prompts)
    tokens, segments = np.zeros((B, width), np.int32), np.ones((B, width), np.int32)
    mask = np.zeros((B, width), np.int32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        end = len(prompt) + len(completion)
        tokens[row, :end] = prompt + completion
        segments[row, :end] = 0
        mask[row, len(prompt):end] = 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (B, width)).copy()
    return PackedRows(tokens, segments, positions, mask, advantages_B=np.asarray(advantages, np.float32))


class Rollouts:
    """sample(rollout, params) -> Rollout: the rollout's prompts, completions, rewards and rows."""

    def __init__(self, session, model: LaidOutModel, prompts: PromptSet, reward: Reward, codec: TextCodec,
                 stop_ids: frozenset[int]):
        cfg, rl = session.cfg, session.cfg.rl
        self.prompts, self.reward, self.codec, self.group = prompts, reward, codec, rl.group_size
        self.batch, self.width = cfg.train.batch_size, cfg.model.seq_len + 1
        sampling = Sampling(rl.temperature, rl.top_k, rl.top_p, cfg.train.seed)
        shape = Shape(self.batch, prompts.longest(), rl.max_new_tokens)
        self.generator = BatchedGenerator(model.graphdef, cfg.model, session.precision, shape, sampling,
                                          stop_ids, model.layout)

    def sample(self, rollout: int, params) -> Rollout:
        jax.block_until_ready(params)  # the step before it, which it waits for anyway, is not sampling's time
        start = time.perf_counter()
        picked = [i for i in self.prompts.take(rollout, self.batch // self.group) for _ in range(self.group)]
        prompt_ids = [self.prompts.ids[i] for i in picked]
        # each completion's draws are keyed by its place in the run: a rollout's rows, numbered on
        completions = self.generator(params, prompt_ids, [rollout * self.batch + r for r in range(self.batch)])
        generate_s = time.perf_counter() - start
        stops = set(self.generator.stop_ids.tolist())
        texts = [self.codec.decode(c[:-1] if c and c[-1] in stops else c) for c in completions]
        records = [self.prompts.records[i] for i in picked]
        rewards = score_all(self.reward, [r[PROMPT_FIELD] for r in records], texts, records)
        rows = training_rows(prompt_ids, completions, group_advantages(rewards, self.group), self.width)
        metrics = {"reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
                   "completion_tokens": float(np.mean([len(c) for c in completions])), "generate_s": generate_s}
        return Rollout(rows, metrics)


class Scoring:
    """batch(params, rows) -> the rows on the mesh with sampled_BL (the log-probabilities of `params`, the
    weights that sampled them) and, with rl.kl_beta > 0, reference_BL (the adapters off, or `reference`'s)."""

    def __init__(self, model: LaidOutModel, reference=None):
        cfg = model.cfg
        self.model, self.reference = model, reference
        self.kl = cfg.rl.kl_beta > 0
        self._scored = jax.jit(self._traced)

    def batch(self, params, rows: PackedRows) -> PackedRows:
        return self._scored(params, self.reference, self.model.put_batch(rows))

    def _traced(self, params, reference, batch: PackedRows) -> PackedRows:
        model = self.model
        chunks, precision = model.cfg.train.loss_chunks, model.precision

        def log_probs(weights):
            return -target_losses(model.graphdef, weights, batch, precision, chunks)

        with layout_hooks(eval_hooks(model.layout)):
            sampled_BL = log_probs(params)
            reference_BL = None
            if self.kl:
                reference_BL = log_probs(without_adapters(params) if reference is None else reference)
        return dataclasses.replace(batch, sampled_BL=jax.lax.stop_gradient(sampled_BL),
                                   reference_BL=None if reference_BL is None else jax.lax.stop_gradient(reference_BL))
