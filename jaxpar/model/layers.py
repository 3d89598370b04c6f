"""Small building blocks: RMS normalization and rotary position embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model.axes import ones_param


class RMSNorm(nnx.Module):
    """Root-mean-square normalization over the model dimension, computed in fp32."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        self.scale = ones_param((d_model,), ("embed",))
        self.eps = eps

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x32 = x_BLD.astype(jnp.float32)
        norm = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * norm * self.scale[...].astype(jnp.float32)).astype(x_BLD.dtype)


def rotary(x_BLHK: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotate pairs of head dimensions by position-dependent angles (RoPE, half-split form)."""
    L, K = x_BLHK.shape[1], x_BLHK.shape[3]
    inv_freq = base ** (-jnp.arange(0, K // 2, dtype=jnp.float32) / (K // 2))
    angle_LK = jnp.arange(L, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(angle_LK)[None, :, None, :], jnp.cos(angle_LK)[None, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
