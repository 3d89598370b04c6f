"""Multi-head latent attention (model.mla; jaxpar.model.mla): ranks that fit the model, and what it does
not combine with."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.config.mla import MLAConfig
from jaxpar.features.feature import Checks, Switch

SWITCHES: tuple[Switch, ...] = ()  # it changes what the model computes, not how a layout splits it

# ordinary attention's options that latent attention has no place for: key -> the value that leaves it off
NOT_WITH_MLA = {"qkv_bias": False, "qk_norm": False, "out_bias": False, "sinks": False, "attn_softcap": 0.0,
                "window": 0, "head_dim": 0}


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    m, mla = cfg.model, cfg.model.mla
    if mla.kv_rank < 0:
        yield f"model.mla.kv_rank must be 0 (ordinary attention) or positive, got {mla.kv_rank}."
    if not mla.enabled:
        changed = [key for key in ("q_rank", "rope_dim", "nope_dim", "v_dim") if getattr(mla, key) != getattr(
            MLAConfig(), key)]
        if changed and mla.kv_rank == 0:
            yield (f"model.mla.{changed[0]} is set but model.mla.kv_rank is 0, so attention is not latent; give "
                   f"model.mla.kv_rank (say 512) to turn it on.")
        return
    yield from _ranks(m)
    yield from _combinations(cfg)


def _ranks(m) -> Checks:
    mla = m.mla
    if mla.rope_dim <= 0 or mla.rope_dim % 2:
        yield (f"model.mla.rope_dim must be positive and even (rotary dimensions turn in pairs), "
               f"got {mla.rope_dim}.")
    for key in ("nope_dim", "v_dim"):
        if getattr(mla, key) <= 0:
            yield f"model.mla.{key} must be positive, got {getattr(mla, key)}."
    if mla.q_rank < 0:
        yield f"model.mla.q_rank must be 0 (queries from the model width) or positive, got {mla.q_rank}."
    for key in ("kv_rank", "q_rank"):
        if getattr(mla, key) > m.d_model:
            yield (f"model.mla.{key}={getattr(mla, key)} is wider than model.d_model={m.d_model}: a latent "
                   f"compresses the model width, so its rank must be at most d_model.")


def _combinations(cfg: Config) -> Checks:
    m = cfg.model
    if m.positions != "rope":
        yield "model.mla needs model.positions=rope: its shared key carries the positions by rotation."
    if m.n_kv_heads not in (0, m.n_heads):
        yield (f"model.mla rebuilds a key and value for every head from the latent; leave model.n_kv_heads at 0, "
               f"got {m.n_kv_heads}.")
    set_keys = [key for key, off in NOT_WITH_MLA.items() if getattr(m, key) != off]
    if set_keys:
        yield (f"model.mla does not combine with model.{set_keys[0]} (latent attention takes none of "
               f"{', '.join(NOT_WITH_MLA)}; its heads' widths are model.mla.nope_dim, rope_dim and v_dim).")
    if m.attention == "cudnn":
        yield "model.mla does not run on cuDNN's fused kernel; use model.attention=flash or dot."
    if m.lora.enabled:
        yield "model.lora does not take adapters on latent attention's weights (model.mla) yet."
