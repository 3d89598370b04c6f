"""Reinforcement learning from verifiable rewards (train.objective=grpo, the rl section): the group
size and the batch it divides, the sampling settings, and the layouts that can sample (jaxpar.sampling
runs on meshes without stages or context parallelism)."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.config.objectives import objective_of
from jaxpar.config.rl import RLConfig
from jaxpar.features.feature import Checks, Switch

SWITCHES: tuple[Switch, ...] = ()  # the objective changes what trains, not how a layout computes it


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    rl, t = cfg.rl, cfg.train
    if not objective_of(cfg).samples:
        if rl != RLConfig():
            yield "the rl section is set but train.objective is not grpo; set train.objective=grpo."
        return
    if rl.group_size < 2:
        yield (f"rl.group_size must be at least 2: GRPO's advantage is a completion's reward against its group's, "
               f"got {rl.group_size}.")
    elif t.batch_size % rl.group_size:
        yield (f"train.batch_size={t.batch_size} must be a multiple of rl.group_size={rl.group_size}: each step "
               f"samples batch_size / group_size prompts.")
    yield from _sampling(cfg)
    if rl.clip <= 0 or rl.kl_beta < 0:
        yield f"rl.clip must be positive and rl.kl_beta at least 0, got {rl.clip} and {rl.kl_beta}."
    if rl.updates_per_batch < 1:
        yield f"rl.updates_per_batch must be at least 1, got {rl.updates_per_batch}."
    yield from _layout(cfg, sizes)


def _sampling(cfg: Config) -> Checks:
    rl = cfg.rl
    if not 1 <= rl.max_new_tokens < cfg.model.seq_len:
        yield (f"rl.max_new_tokens must be at least 1 and below model.seq_len={cfg.model.seq_len} (the prompt takes "
               f"the rest of a row), got {rl.max_new_tokens}.")
    if rl.temperature <= 0:
        yield (f"rl.temperature must be positive: greedy completions of one prompt are all the same, so their "
               f"advantages are 0; got {rl.temperature}.")
    if not 0 < rl.top_p <= 1:
        yield f"rl.top_p must be in (0, 1], got {rl.top_p}."
    if not 0 <= rl.top_k <= cfg.model.vocab_size:
        yield f"rl.top_k must be between 0 (the whole vocabulary) and model.vocab_size, got {rl.top_k}."


def _layout(cfg: Config, sizes: dict[str, int]) -> Checks:
    if sizes["stage"] > 1 or sizes["context"] > 1:
        yield ("train.objective=grpo samples on the training mesh, and generation runs without stages or context "
               "parallelism; set mesh.stage=1 and mesh.context=1.")
    if cfg.model.moe.experts and cfg.model.moe.router == "expert_choice":
        yield ("train.objective=grpo samples one token at a time, which expert_choice routing (over the whole "
               "routing group) cannot; pick another model.moe.router.")
    if cfg.parallel.sync_every > 1 or cfg.train.offloads_optimizer:
        yield "train.objective=grpo does not combine with local SGD or train.offload=optimizer yet."
    if cfg.train.eval_every:
        yield "train.objective=grpo holds out no validation windows; its reward is in every metrics line, so leave " \
              "train.eval_every at 0."
    if cfg.data.packing != "none" or cfg.data.mixture:
        yield ("train.objective=grpo builds its rows from prompts and their completions; leave data.packing and "
               "data.mixture unset.")
