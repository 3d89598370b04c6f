"""Mixture of experts and expert parallelism: the experts of each MoE layer split over mesh.expert
(which acts as extra data parallelism outside MoE layers, and for a dense model), with the router
and its options under model.moe. Derives model.moe.group_size=0 for the mesh."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.data import routed_tokens_per_device
from jaxpar.features.feature import Checks, Switch, axis

SWITCHES = (Switch("mesh.expert", axis("expert"), reference=1, searched=True, with_local_sgd=False),)
MAX_AUTO_GROUP = 256


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    moe, m = cfg.model.moe, cfg.model
    if moe.experts < 0:
        yield f"model.moe.experts must be 0 (dense) or positive, got {moe.experts}."
    if moe.experts <= 0:
        return  # a dense model uses the expert axis as extra data parallelism
    if moe.experts % sizes["expert"]:
        yield f"model.moe.experts={moe.experts} is not divisible by mesh.expert={sizes['expert']}."
    if moe.every <= 0 or m.n_layers % moe.every:
        yield f"model.n_layers={m.n_layers} is not divisible by model.moe.every={moe.every}."
    elif m.n_layers % m.unit_blocks:
        yield (f"model.n_layers={m.n_layers} is not divisible by {m.unit_blocks}, the period of model.moe.every="
               f"{moe.every} and model.attention_pattern={m.attention_pattern!r}.")
    if moe.chooses_top_k and not 0 < moe.top_k <= moe.experts:
        yield f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={moe.experts}."
    if moe.capacity_factor <= 0:
        yield f"model.moe.capacity_factor must be positive, got {moe.capacity_factor}."
    yield from _expert_shape(cfg, sizes["tensor"])
    tokens = routed_tokens_per_device(cfg, sizes)
    if moe.group_size < 0 or (moe.group_size and tokens % moe.group_size):
        yield (f"model.moe.group_size={moe.group_size} does not divide the {tokens} tokens per device "
               "(train.batch_size / (data x expert x microbatches) x model.seq_len, microbatches being "
               "train.grad_accum or parallel.pipeline.microbatches); leave it 0 to fit.")


def _expert_shape(cfg: Config, tensor: int) -> Checks:
    """Expert widths and the router options that only top-k takes."""
    moe, m = cfg.model.moe, cfg.model
    for key in ("d_ff", "shared"):
        if getattr(moe, key) < 0:
            yield f"model.moe.{key} must be 0 or positive, got {getattr(moe, key)}."
    for key in ("routed_scale", "bias_rate"):
        if not getattr(moe, key) > 0:
            yield f"model.moe.{key} must be positive, got {getattr(moe, key)}."
    if m.expert_d_ff % tensor:
        yield (f"the experts' width {m.expert_d_ff} (model.moe.d_ff, or model.d_ff when 0) is not "
               f"divisible by mesh.tensor={tensor}.")
    topk_only = {"score": moe.score != "softmax", "renormalize": not moe.renormalize, "balance": moe.balance != "aux"}
    chosen = [f"model.moe.{key}={getattr(moe, key)}" for key, set_ in topk_only.items() if set_]
    if chosen and not moe.chooses_top_k:
        yield (f"{chosen[0]} needs model.moe.router=topk or dropless, but the router is {moe.router} "
               f"(Switch picks one expert by softmax, and Expert Choice fills every expert exactly).")


def derive(cfg: Config, sizes: dict[str, int]) -> Config:
    """model.moe.group_size=0 becomes the largest divisor of the tokens per device up to 256. Routing
    groups are then consecutive tokens of the global batch, the same on every layout that shares the
    value (verify's single-device reference takes it from the layout)."""
    moe = cfg.model.moe
    if not moe.experts or moe.group_size:
        return cfg
    tokens = routed_tokens_per_device(cfg, sizes)
    size = max(d for d in range(1, min(tokens, MAX_AUTO_GROUP) + 1) if tokens % d == 0)
    return cfg.replace(**{"model.moe.group_size": size})
