"""Mixture of experts and expert parallelism: the experts of each MoE layer split over mesh.expert
(which acts as extra data parallelism outside MoE layers, and for a dense model), with the router
and its options under model.moe. Derives model.moe.group_size=0 for the mesh."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.data import routed_tokens_per_device
from jaxpar.features.feature import Checks, Switch, axis, unless

SWITCHES = (Switch("mesh.expert", axis("expert"), reference=1, searched=True, with_local_sgd=False),
            Switch("parallel.expert_dispatch", unless("allgather", "dispatch={value}"), reference="allgather"))
MAX_AUTO_GROUP = 256


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    moe, m = cfg.model.moe, cfg.model
    yield from _dispatch(cfg, sizes["expert"])
    if moe.experts < 0:
        yield f"model.moe.experts must be 0 (dense) or positive, got {moe.experts}."
    if moe.experts <= 0:
        return  # a dense model uses the expert axis as extra data parallelism
    if moe.experts % sizes["expert"]:
        yield f"model.moe.experts={moe.experts} is not divisible by mesh.expert={sizes['expert']}."
    if not 0 <= moe.first_dense < m.n_layers:
        yield f"model.moe.first_dense={moe.first_dense} must be between 0 and model.n_layers - 1 = {m.n_layers - 1}."
    elif moe.every <= 0 or m.unit_layers % moe.every:
        yield f"{_layers(m)} is not divisible by model.moe.every={moe.every}."
    elif m.unit_layers % m.unit_blocks:
        yield (f"{_layers(m)} is not divisible by {m.unit_blocks}, the period of model.moe.every={moe.every} and "
               f"model.attention_pattern={m.attention_pattern!r}.")
    if moe.chooses_top_k and not 0 < moe.top_k <= moe.experts:
        yield f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={moe.experts}."
    if moe.capacity_factor <= 0:
        yield f"model.moe.capacity_factor must be positive, got {moe.capacity_factor}."
    yield from _expert_shape(cfg, sizes["tensor"])
    yield from _groups(moe)
    if moe.first_dense and m.window and m.attention_pattern:
        yield ("model.moe.first_dense takes no model.attention_pattern: the dense first layers are stacked "
               "alike, so their attention kind cannot alternate.")
    tokens = routed_tokens_per_device(cfg, sizes)
    if moe.group_size < 0 or (moe.group_size and tokens % moe.group_size):
        yield (f"model.moe.group_size={moe.group_size} does not divide the {tokens} tokens per device "
               "(train.batch_size / (data x expert x microbatches) x model.seq_len, microbatches being "
               "train.grad_accum or parallel.pipeline.microbatches); leave it 0 to fit.")


def _layers(m) -> str:
    """The layers the units stack, as a sentence's subject."""
    if m.moe.first_dense:
        return f"the {m.unit_layers} layers after model.moe.first_dense={m.moe.first_dense}"
    return f"model.n_layers={m.n_layers}"


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
    topk_only = {"score": moe.score != "softmax", "renormalize": not moe.renormalize, "balance": moe.balance != "aux",
                 "expert_groups": moe.expert_groups != 1}
    chosen = [f"model.moe.{key}={getattr(moe, key)}" for key, set_ in topk_only.items() if set_]
    if chosen and not moe.chooses_top_k:
        yield (f"{chosen[0]} needs model.moe.router=topk or dropless, but the router is {moe.router} "
               f"(Switch picks one expert by softmax, and Expert Choice fills every expert exactly).")


def _groups(moe) -> Checks:
    """Group-limited routing: equal groups of at least two experts (a group scores by its best two),
    and enough experts in the chosen groups for top_k."""
    if moe.expert_groups < 1 or moe.experts % moe.expert_groups:
        yield f"model.moe.expert_groups={moe.expert_groups} must divide model.moe.experts={moe.experts}."
    elif moe.expert_groups > 1 and moe.experts // moe.expert_groups < 2:
        yield (f"model.moe.expert_groups={moe.expert_groups} leaves fewer than 2 experts per group; a group "
               "scores by the sum of its two best.")
    elif not 1 <= moe.topk_groups <= moe.expert_groups:
        yield (f"model.moe.topk_groups={moe.topk_groups} must be between 1 and model.moe.expert_groups="
               f"{moe.expert_groups}.")
    elif moe.chooses_top_k and (open_experts := moe.topk_groups * (moe.experts // moe.expert_groups)) < moe.top_k:
        yield (f"the model.moe.topk_groups={moe.topk_groups} groups hold {open_experts} experts, fewer than "
               f"model.moe.top_k={moe.top_k}.")


def _dispatch(cfg: Config, expert: int) -> Checks:
    """parallel.expert_dispatch=ragged: dropless routing's assignments sent over mesh.expert by ragged all-to-all."""
    moe = cfg.model.moe
    if cfg.parallel.expert_dispatch != "ragged":
        return
    if expert == 1:
        yield "parallel.expert_dispatch=ragged sends rows between expert devices, so it needs mesh.expert > 1."
    elif moe.experts <= 0 or moe.router != "dropless":
        yield (f"parallel.expert_dispatch=ragged dispatches model.moe.router=dropless only, but the model has "
               f"{f'router={moe.router}' if moe.experts > 0 else 'no experts (model.moe.experts=0)'} (the capacity "
               f"routers' all-to-all already sends each expert device only its slots).")


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
