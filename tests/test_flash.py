"""Blockwise causal attention (jaxpar.model.flash) against plain dot-product attention."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.model.flash import flash_attention

B, L, H, K = 2, 64, 2, 8
BLOCKS = [(16, 16), (16, 32), (32, 16), (8, 64), (64, 64)]  # includes block_q != block_kv and blocks == L


def dot_attention(q_BLHK, k_BLHK, v_BLHK):
    """The reference: an L×P score matrix, causal mask, softmax, in fp32."""
    q_BLHK, k_BLHK, v_BLHK = (x.astype(jnp.float32) for x in (q_BLHK, k_BLHK, v_BLHK))
    scores_BHLP = jnp.einsum("BLHK,BPHK->BHLP", q_BLHK, k_BLHK) / math.sqrt(q_BLHK.shape[-1])
    n = q_BLHK.shape[1]
    scores_BHLP = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores_BHLP, -jnp.inf)
    return jnp.einsum("BHLP,BPHK->BLHK", jax.nn.softmax(scores_BHLP, axis=-1), v_BLHK)


def qkv(shape=(B, L, H, K), dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, shape, dtype) for k in keys)


def weighted_sum(attention, weights_BLHK):
    return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * weights_BLHK)


def flash(block_q, block_kv):
    return lambda q, k, v: flash_attention(q, k, v, block_q=block_q, block_kv=block_kv)


def rel_err(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


@pytest.mark.parametrize("block_q,block_kv", BLOCKS)
def test_forward_matches_dot_attention(block_q, block_kv):
    q, k, v = qkv()
    out = jax.jit(flash(block_q, block_kv))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, dot_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_q,block_kv", BLOCKS)
def test_gradients_match_dot_attention(block_q, block_kv):
    q, k, v = qkv()
    weights = jax.random.normal(jax.random.key(1), q.shape)
    got = jax.jit(jax.grad(weighted_sum(flash(block_q, block_kv), weights), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(weighted_sum(dot_attention, weights), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == jnp.float32
        assert rel_err(g, w) < 1e-5, name


@pytest.mark.parametrize("block_q,block_kv", [(16, 16), (16, 32), (32, 16)])
def test_blocks_above_the_diagonal_are_skipped(block_q, block_kv):
    """NaN keys/values in key blocks after query block 0 must not reach its rows: with a mask
    (rather than a skip) the NaNs would survive as 0 * NaN in probs @ v."""
    q, k_clean, v_clean = qkv()
    first_skipped = -(-block_q // block_kv) * block_kv  # first key block query block 0 never visits
    k = k_clean.at[:, first_skipped:].set(jnp.nan)
    v = v_clean.at[:, first_skipped:].set(jnp.nan)
    attention = flash(block_q, block_kv)
    out = jax.jit(attention)(q, k, v)
    assert bool(jnp.isfinite(out[:, :block_q]).all())
    assert bool(jnp.isnan(out[:, first_skipped:]).all())  # the NaNs are real and do propagate later on
    # (The dense reference masks, so on these inputs it would be NaN everywhere: compare with clean ones.)
    np.testing.assert_allclose(out[:, :block_q], dot_attention(q, k_clean, v_clean)[:, :block_q], rtol=1e-5,
                               atol=1e-6)

    def first_block_loss(q):
        return jnp.sum(attention(q, k, v)[:, :block_q])

    dq = jax.jit(jax.grad(first_block_loss))(q)
    assert bool(jnp.isfinite(dq[:, :block_q]).all())


@pytest.mark.slow
def test_memory_is_far_below_dot_attention():
    q, k, v = qkv((1, 1024, 2, 16))
    weights = jnp.ones(q.shape)

    def temp_bytes(attention):
        loss = weighted_sum(attention, weights)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    flash_bytes, dot_bytes = temp_bytes(flash(128, 128)), temp_bytes(dot_attention)
    print(f"temp bytes: flash {flash_bytes}, dot {dot_bytes}, ratio {flash_bytes / dot_bytes:.4f}")
    assert flash_bytes <= 0.2 * dot_bytes, (flash_bytes, dot_bytes)


@pytest.mark.slow
def test_bf16_inputs():
    q, k, v = qkv(dtype=jnp.bfloat16)
    attention = flash(16, 32)
    out = jax.jit(attention)(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), dot_attention(q, k, v), rtol=2e-2, atol=2e-2)
    weights = jax.random.normal(jax.random.key(1), q.shape)
    got = jax.jit(jax.grad(weighted_sum(attention, weights), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(weighted_sum(dot_attention, weights), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g.astype(jnp.float32), w) < 2e-2, name


@pytest.mark.slow
def test_sharded_over_batch_and_heads():
    """Under jit with B over one mesh axis and H over another, results match the unsharded run."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec("data", None, "tensor", None))
    q, k, v = qkv((4, 32, 2, 8))
    weights = jax.random.normal(jax.random.key(1), q.shape)
    step = jax.jit(jax.value_and_grad(weighted_sum(flash(8, 16), weights), argnums=(0, 1, 2)))
    loss, grads = step(*(jax.device_put(x, sharding) for x in (q, k, v)))
    want_loss, want_grads = step(q, k, v)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert g.sharding.is_equivalent_to(sharding, g.ndim)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
