"""Low-rank adapters on frozen weights (model.lora; jaxpar.model.adapters): which weights take
them, and what they do not combine with yet."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.config.adapters import LORA_TARGETS, LoRAConfig
from jaxpar.features.feature import Checks, Switch

SWITCHES: tuple[Switch, ...] = ()  # the adapters change what trains, not how a layout computes it


def target_dims(cfg: Config) -> dict[str, tuple[int, int]]:
    """Each target's (inputs, outputs) per token: the sides of the matrix A B stands beside."""
    m = cfg.model
    q, kv = m.n_heads * m.head_size, m.kv_heads * m.head_size
    dims = {"q": (m.d_model, q), "k": (m.d_model, kv), "v": (m.d_model, kv), "o": (q, m.d_model),
            "gate": (m.d_model, m.d_ff), "up": (m.d_model, m.d_ff), "down": (m.d_ff, m.d_model)}
    if m.moe.experts:
        dims["experts"] = (m.d_model, m.expert_d_ff)
    return dims


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    lora = cfg.model.lora
    if lora.rank < 0:
        yield f"model.lora.rank must be 0 (no adapters) or positive, got {lora.rank}."
    if lora.rank <= 0:
        changed = [key for key in ("alpha", "dropout", "targets", "base_dtype", "from_peft")
                   if getattr(lora, key) != getattr(LoRAConfig(), key)]
        if changed and lora.rank == 0:
            yield (f"model.lora.{changed[0]} is set but model.lora.rank is 0, so there are no adapters; give "
                   f"model.lora.rank (say 16).")
        return
    yield from _targets(cfg)
    if lora.alpha <= 0:
        yield f"model.lora.alpha must be positive, got {lora.alpha}."
    if not 0 <= lora.dropout < 1:
        yield f"model.lora.dropout must be at least 0 and below 1, got {lora.dropout}."
    if lora.dropout and cfg.model.moe.experts:
        yield "model.lora.dropout on a mixture of experts is not built yet (its experts' adapters are merged)."
    if lora.base_dtype in ("int8", "nf4") and cfg.model.d_model % 64:
        yield (f"model.lora.base_dtype={lora.base_dtype} quantizes blocks of 64 along d_model, so model.d_model "
               f"must be a multiple of 64, not {cfg.model.d_model}.")
    yield from _not_yet(cfg, sizes)


def _targets(cfg: Config) -> Checks:
    lora, dims = cfg.model.lora, target_dims(cfg)
    if not lora.target_set:
        yield f"model.lora.targets names no weight; name some of {', '.join(LORA_TARGETS)}."
    for target in lora.target_set:
        if target not in LORA_TARGETS:
            yield f"model.lora.targets: unknown target {target!r}; the targets are {', '.join(LORA_TARGETS)}."
        elif target == "experts" and not cfg.model.moe.experts:
            yield "model.lora.targets names experts, but the model has none (model.moe.experts=0)."
        elif lora.rank > min(dims[target]):
            yield (f"model.lora.rank={lora.rank} exceeds the {target} weight's smaller side, {min(dims[target])}: "
                   f"a rank above it adds nothing a full update would not.")


def _not_yet(cfg: Config, sizes: dict[str, int]) -> Checks:
    """Combinations whose state or step the adapters have not been verified with."""
    t, p = cfg.train, cfg.parallel
    if sizes["stage"] > 1 and p.pipeline.schedule in ("zb-h1", "zbv"):  # (a schedule matters only over stages)
        yield (f"model.lora does not run with parallel.pipeline.schedule={p.pipeline.schedule} yet; use 1f1b, "
               f"interleaved, 2bw or gpipe.")
    if t.offloads_optimizer or p.sync_every > 1:
        what = f"train.offload={t.offload}" if t.offloads_optimizer else "local SGD (parallel.sync_every > 1)"
        yield f"model.lora does not run with {what} yet."
    if cfg.model.moe.experts and cfg.model.moe.balance == "bias":
        yield "model.lora freezes the router, so model.moe.balance=bias has no bias to move; use aux."
