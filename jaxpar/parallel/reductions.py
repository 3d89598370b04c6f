"""The data-parallel gradient reductions written by hand (inside a shard_map manual over the
batch axes): their payload dtype is parallel.grad_reduce_dtype. And dropless routing's exchange of
rows over `expert`, forward and backward, built from the same pieces (rows_gathered, rows_summed).

fp32 sends the gradient as fp32 whatever the compute dtype: XLA's all-reduce and reduce-scatter.
bf16 sends it as bf16, half the bytes of fp32, and sums in fp32 where it arrives: a reduce-scatter
is an all-to-all of bf16 blocks (each device sends every other device the block it owns, the
bytes a ring reduce-scatter sends) followed by an fp32 sum of the blocks received; an all-reduce
is that reduce-scatter and an all-gather of the bf16-rounded sums (the bytes of a ring
all-reduce). The result is fp32, so what reaches the optimizer and the fp32 master weights stays
fp32; only the payload is rounded to bf16.

Why not a bf16 all-reduce: XLA:CPU aborts on one inside the step ("Invalid binary instruction
opcode copy", jax 0.12.0.1), it widens bf16 all-to-alls and all-gathers to fp32 (sending fp32
bytes), and an fp32 sum of bf16 payloads is the more accurate reduction anyway. So the blocks
travel as their 16-bit patterns (uint16), which no backend widens: moving data needs no arithmetic.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def _from_bits(bits: jax.Array, payload) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, payload)


def moved_as_bits(move, x: jax.Array) -> jax.Array:
    """move(x) (an all-gather written by hand) of a 16-bit float x, moved as its bit patterns: XLA:CPU
    widens a bf16 all-gather to fp32, converting up, sending twice the bytes and converting back; the
    same values, bit for bit, either way. (Around a sharding constraint the partitioner folds the two
    bit casts away, and its all-gather is widened as before.)"""
    if x.dtype.itemsize != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return move(x)
    return _from_bits(move(_as_bits(x)), x.dtype)


def _devices(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in ((axes,) if isinstance(axes, str) else axes))


def scattered(grad: jax.Array, axes, dim: int, payload) -> jax.Array:
    """The reduce-scatter (sum over `axes`, this device's block of `dim`) of a gradient, sent as
    `payload`; fp32 result."""
    if jnp.dtype(payload) == jnp.float32:
        return jax.lax.psum_scatter(grad.astype(jnp.float32), axes, scatter_dimension=dim, tiled=True)
    n = _devices(axes)
    bits = jax.lax.all_to_all(_as_bits(jnp.moveaxis(grad.astype(payload), dim, 0)), axes, 0, 0, tiled=True)
    blocks = _from_bits(bits, payload)
    mine = blocks.reshape(n, blocks.shape[0] // n, *blocks.shape[1:]).astype(jnp.float32).sum(0)
    return jnp.moveaxis(mine, 0, dim)


def summed(grad: jax.Array, axes, payload) -> jax.Array:
    """The all-reduce (sum over `axes`) of a gradient, sent as `payload`; fp32 result."""
    if jnp.dtype(payload) == jnp.float32:
        return jax.lax.psum(grad.astype(jnp.float32), axes)
    n = _devices(axes)
    flat = grad.reshape(-1)
    padded = jnp.pad(flat, (0, -flat.size % n))  # whole blocks for every device
    mine = _as_bits(scattered(padded, axes, 0, payload).astype(payload))
    whole = _from_bits(jax.lax.all_gather(mine, axes, axis=0, tiled=True), payload).astype(jnp.float32)
    return whole[:flat.size].reshape(grad.shape)


def _gather_rows(x: jax.Array, axes) -> jax.Array:
    return moved_as_bits(lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True), x)


def _sum_rows(x: jax.Array, axes) -> jax.Array:
    return scattered(x, axes, 0, x.dtype).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rows_gathered(x: jax.Array, axes) -> jax.Array:
    """Every shard's rows of a float x over `axes` (an all-gather); its gradient, each shard's rows summed
    over the shards (`scattered` in x's dtype: in bf16 no bf16 reduce-scatter, which XLA:CPU aborts on)."""
    return _gather_rows(x, axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rows_summed(x: jax.Array, axes) -> jax.Array:
    """Each shard's rows of x summed over the shards of `axes` (`scattered` in x's dtype); its gradient,
    every shard's rows (an all-gather)."""
    return _sum_rows(x, axes)


rows_gathered.defvjp(lambda x, axes: (_gather_rows(x, axes), None), lambda axes, _, grad: (_sum_rows(grad, axes),))
rows_summed.defvjp(lambda x, axes: (_sum_rows(x, axes), None), lambda axes, _, grad: (_gather_rows(grad, axes),))
