"""The model's own shape (model.*): widths, heads, rotary positions and their scaling, and the
attention kernel (model.attention: dot, flash, cudnn or auto)."""

from __future__ import annotations

from jaxpar.config import Config, ConfigError, precision
from jaxpar.features.feature import Checks, Switch, unless

SWITCHES = (Switch("model.attention", unless("dot", "attention={value}"), reference="dot"),)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    m = cfg.model
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len", "vocab_multiple"):
        if getattr(m, key) <= 0:
            yield f"model.{key} must be positive, got {getattr(m, key)}."
    if m.head_dim < 0:
        yield f"model.head_dim must be 0 (d_model / n_heads) or positive, got {m.head_dim}."
    if not m.head_dim and m.d_model % m.n_heads and not m.mla.enabled:  # latent heads have widths of their own
        yield (f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; "
               f"set model.head_dim to give the heads their own width.")
    if m.positions == "rope" and m.head_size % 2 and not m.mla.enabled:
        yield (f"rotary positions need an even head size, but it is {m.head_size} "
               f"(model.head_dim, or model.d_model / model.n_heads).")
    yield from _rope(m)
    yield from _attention(cfg)
    yield from _variants(m)


def _rope(m) -> Checks:
    if m.rope_scaling == "none":
        return
    if m.positions != "rope":
        yield f"model.rope_scaling={m.rope_scaling} needs model.positions=rope."
    if m.rope_factor <= 0:
        yield f"model.rope_factor must be positive, got {m.rope_factor}."
    if m.rope_scaling == "llama3" and not (0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                                           and m.rope_original_context > 0):
        yield ("llama3 rope scaling needs 0 < model.rope_low_freq_factor < model.rope_high_freq_factor "
               "and a positive model.rope_original_context.")


def _attention(cfg: Config) -> Checks:
    m = cfg.model
    if m.n_kv_heads < 0 or m.n_kv_heads > m.n_heads or (m.n_kv_heads and m.n_heads % m.n_kv_heads):
        yield f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (0: as many as n_heads)."
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        yield "model.rope_theta and model.norm_eps must be positive."
    if m.flash_block_q <= 0 or m.flash_block_kv <= 0:
        yield "model.flash_block_q and model.flash_block_kv must be positive."
    if m.attention in ("flash", "auto"):
        for key, block in zip(("flash_block_q", "flash_block_kv"), m.flash_blocks()):
            if m.seq_len % block:
                yield f"model.{key}={block} does not divide model.seq_len={m.seq_len}."
    if m.attention == "cudnn" and not precision.of(cfg).reduced:
        yield ("model.attention=cudnn needs train.precision=bf16 or fp16 (cuDNN's fused attention "
               "has no fp32 kernel); use flash or dot for fp32.")


def _variants(m) -> Checks:
    """Sliding windows, their pattern over the layers, soft caps, the score scale and sinks."""
    if m.window < 0:
        yield f"model.window must be 0 (every earlier position) or positive, got {m.window}."
    elif m.window > m.seq_len and not m.from_hf:  # a checkpoint's window stays (its export writes it back)
        yield (f"model.window={m.window} is longer than model.seq_len={m.seq_len} and would hide nothing; "
               f"set model.window=0 for full causal attention.")
    if m.attention_pattern:
        if set(m.attention_pattern) - {"l", "g"}:
            yield (f"model.attention_pattern={m.attention_pattern!r} may hold only the letters l (a local, "
                   f"windowed layer) and g (a global one).")
        elif m.n_layers % len(m.attention_pattern):
            yield (f"model.attention_pattern={m.attention_pattern!r} repeats over the layers, so its length "
                   f"{len(m.attention_pattern)} must divide model.n_layers={m.n_layers}.")
        if not m.window:
            yield (f"model.attention_pattern={m.attention_pattern!r} chooses the windowed layers, but model.window=0; "
                   f"set model.window as well.")
    if m.attn_softcap < 0 or m.attn_scale < 0:
        yield ("model.attn_softcap and model.attn_scale must be 0 (off; 1 / sqrt(head size)) or positive, "
               f"got {m.attn_softcap} and {m.attn_scale}.")
    if m.attention == "cudnn" and (m.sinks or m.attn_softcap):
        yield "model.attention=cudnn has no soft cap or sinks (model.attn_softcap, model.sinks); use flash or dot."


def check_attention_platform(cfg: Config, platform: str) -> None:
    """model.attention=cudnn runs on NVIDIA GPUs only (checked once the devices are known)."""
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention=cudnn needs an NVIDIA GPU, but the devices are {platform}; "
                          f"use flash (or auto, which picks cudnn where it runs).")
