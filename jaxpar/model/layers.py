"""Small building blocks: RMS normalization and rotary position embedding."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.model.axes import ones_param

if TYPE_CHECKING:  # annotations only
    from jaxpar.config import ModelConfig


class RMSNorm(nnx.Module):
    """Root-mean-square normalization over the last dimension, computed in fp32.

    `names` are the logical names of the scale: the model width by default, ("kv",) for the
    per-head query and key norms of Qwen 3."""

    def __init__(self, size: int, eps: float = 1e-5, names: tuple[str, ...] = ("embed",)):
        self.scale = ones_param((size,), names)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * norm * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[float, ...]:
    """The K/2 rotary angular frequencies of a head of width K, with the config's scaling applied.

    Computed in fp32 as transformers computes them, so an imported checkpoint rotates by the same
    angles. `llama3` (Llama 3.1/3.2): frequencies whose wavelength exceeds original_context /
    low_freq_factor are divided by rope_factor, those under original_context / high_freq_factor are
    kept, and the band between is interpolated between the two."""
    K = cfg.head_size
    exponents = np.arange(0, K, 2, dtype=np.int64).astype(np.float32) / np.float32(K)
    inv_freq = (np.float32(1.0) / np.float32(cfg.rope_theta) ** exponents).astype(np.float32)
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
    return tuple(float(f) for f in inv_freq)


def rotary(x_BLHK: jax.Array, frequencies: tuple[float, ...], positions: jax.Array | None = None) -> jax.Array:
    """Rotate pairs of head dimensions by position-dependent angles (RoPE, half-split form, as
    Llama's Hugging Face checkpoints store their weights). positions: each query's position, (L,)
    or per row (B, L) (default 0 ... L-1; a key/value cache passes its offset, a packed row restarts
    at each document)."""
    L = x_BLHK.shape[1]
    positions = jnp.arange(L) if positions is None else positions
    angle_K = positions.astype(jnp.float32)[..., None] * jnp.asarray(frequencies, jnp.float32)[None, :]
    every = slice(None)
    heads = (every, every, None, every) if angle_K.ndim == 3 else (None, every, None, every)
    sin, cos = jnp.sin(angle_K)[heads], jnp.cos(angle_K)[heads]  # (1 or B, L, 1, K/2)
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
