"""Small building blocks: RMS normalization and rotary position embedding."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.model.axes import ones_param, zeros_param

if TYPE_CHECKING:  # annotations only
    from jaxpar.config import ModelConfig


class RMSNorm(nnx.Module):
    """Root-mean-square normalization over the last dimension, computed in fp32.

    `names` are the logical names of the scale: the model width by default, ("kv",) for the
    per-head query and key norms of Qwen 3. With `offset` (Gemma) the scale is 1 + the weight, the
    weight stored as its offset from 1 (zero at the start)."""

    def __init__(self, size: int, eps: float = 1e-5, names: tuple[str, ...] = ("embed",), offset: bool = False):
        self.scale = zeros_param((size,), names) if offset else ones_param((size,), names)
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x32 * norm * (1.0 + scale if self.offset else scale)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False, width: int = 0) -> tuple[float, ...]:
    """The width/2 rotary angular frequencies of a head's `width` rotated dimensions (default the head
    size), with the config's scaling applied; `local`: a windowed layer's, from model.rope_local_theta
    unscaled where it is set (Gemma 3).

    Computed in fp32 as transformers computes them, so an imported checkpoint rotates by the same
    angles. `llama3` (Llama 3.1/3.2): frequencies whose wavelength exceeds original_context /
    low_freq_factor are divided by rope_factor, those under original_context / high_freq_factor are
    kept, and the band between is interpolated between the two. `yarn`: the dimensions that turn
    fewer than beta_slow times over original_context are divided by rope_factor, those turning more
    than beta_fast times kept, and a linear ramp over the dimensions between (rope_attention_factor
    scales the rotated values)."""
    K = width or cfg.head_size
    if local and cfg.rope_local_theta:
        return _inverse_frequencies(K, cfg.rope_local_theta)
    inv_freq = np.asarray(_inverse_frequencies(K, cfg.rope_theta), np.float32)
    if cfg.rope_scaling == "linear":
        inv_freq = inv_freq / np.float32(cfg.rope_factor)
    elif cfg.rope_scaling == "llama3":
        factor, low, high = (np.float32(v) for v in (cfg.rope_factor, cfg.rope_low_freq_factor,
                                                      cfg.rope_high_freq_factor))
        context = np.float32(cfg.rope_original_context)
        wavelength = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelength > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < context / high) & ~(wavelength > context / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif cfg.rope_scaling == "yarn":
        inv_freq = _yarn(cfg, K, inv_freq)
    return tuple(float(f) for f in inv_freq)


def _inverse_frequencies(K: int, theta: float) -> tuple[float, ...]:
    exponents = np.arange(0, K, 2, dtype=np.int64).astype(np.float32) / np.float32(K)
    return tuple(float(f) for f in (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32))


def _yarn(cfg: ModelConfig, K: int, inv_freq: np.ndarray) -> np.ndarray:
    """YaRN's frequencies: kept where a dimension turns fast over the original context, divided by
    rope_factor where it turns slowly, a linear ramp over the dimensions between."""
    def dimension_turning(rotations: float) -> float:  # the dimension that turns `rotations` times
        return K * math.log(cfg.rope_original_context / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dimension_turning(cfg.rope_beta_fast), dimension_turning(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, K - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(K // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = (np.float32(1) - ramp).astype(np.float32)
    exponents = np.arange(0, K, 2, dtype=np.int64).astype(np.float32) / np.float32(K)
    turns = np.float32(cfg.rope_theta) ** exponents
    divided = (np.float32(1) / (np.float32(cfg.rope_factor) * turns)).astype(np.float32)
    return (divided * (np.float32(1) - kept) + inv_freq * kept).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What yarn multiplies the rotated values by (1 otherwise): 0.1 ln(factor) + 1, or with
    rope_mscale_all_dim set, the ratio of that with rope_mscale and with rope_mscale_all_dim."""
    if cfg.rope_scaling != "yarn" or (local and cfg.rope_local_theta) or cfg.rope_factor <= 1:
        return 1.0

    def mscale(weight: float) -> float:
        return 0.1 * weight * math.log(cfg.rope_factor) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg.rope_mscale) / mscale(cfg.rope_mscale_all_dim)
    return mscale(1.0)


def rotary(x_BLHK: jax.Array, frequencies: tuple[float, ...], positions: jax.Array | None = None,
           factor: float = 1.0) -> jax.Array:
    """Rotate pairs of head dimensions by position-dependent angles (RoPE, half-split form, as
    Llama's Hugging Face checkpoints store their weights). positions: each query's position, (L,)
    or per row (B, L) (default 0 ... L-1; a key/value cache passes its offset, a packed row restarts
    at each document). factor: what the rotated values are multiplied by (yarn's attention factor)."""
    L = x_BLHK.shape[1]
    positions = jnp.arange(L) if positions is None else positions
    angle_K = positions.astype(jnp.float32)[..., None] * jnp.asarray(frequencies, jnp.float32)[None, :]
    every = slice(None)
    heads = (every, every, None, every) if angle_K.ndim == 3 else (None, every, None, every)
    sin, cos = jnp.sin(angle_K)[heads], jnp.cos(angle_K)[heads]  # (1 or B, L, 1, K/2)
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    if factor != 1.0:  # as transformers scales its cos and sin
        sin, cos = sin * factor, cos * factor
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
