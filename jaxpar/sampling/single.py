"""Text generation with a key/value cache, so a user can see what a model says: the sample at the end
of a run, and `jaxpar generate`.

The prompt runs once through the model (prefill), filling each layer's cache; every new token then
runs alone, attending to the cache (jaxpar.model.attention.KVCache). Greedy (temperature 0) or
sampled from softmax(logits / temperature), stopping early at an end-of-sequence id. A module of
one's own without `decode` (the Python API trains any module) runs the whole sequence again for
each token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config.model import ModelConfig
from jaxpar.data.token_folder import TextCodec


def _compute_dtype(params) -> jnp.dtype:
    """The dtype the weights compute in (the cache stores keys and values in it)."""
    return next(leaf.dtype for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.floating))


def generate_ids(graphdef: nnx.GraphDef, params, cfg: ModelConfig, prompt_ids: list[int], new_tokens: int,
                 temperature: float = 0.0, seed: int = 0, stop_ids: frozenset[int] = frozenset(),
                 placement: jax.sharding.Sharding | None = None) -> list[int]:
    """The prompt's ids followed by up to `new_tokens` generated ones (fewer when a stop id comes).

    With `placement` (replicated on the weights' mesh) the tokens are placed there, which a
    multi-process run needs: every process then runs the same program on the same tokens."""
    positions = len(prompt_ids) + new_tokens
    put = (lambda a: jax.device_put(a, placement)) if placement is not None else jnp.asarray  # noqa: E731

    @jax.jit
    def prefill(params, tokens_1L):
        model = nnx.merge(graphdef, params)
        logits_1LV, caches = model.decode(tokens_1L, model.empty_caches(cfg, 1, positions, _compute_dtype(params)))
        return logits_1LV[0, -1], caches

    @jax.jit
    def step(params, token_11, caches):
        logits_11V, caches = nnx.merge(graphdef, params).decode(token_11, caches)
        return logits_11V[0, -1], caches

    @jax.jit
    def choose(logits_V, key):
        if temperature == 0:
            return jnp.argmax(logits_V)
        return jax.random.categorical(key, logits_V / temperature)

    @jax.jit
    def recompute(params, tokens_1P, last):  # a module of one's own without decode(): no cache
        return nnx.merge(graphdef, params)(tokens_1P)[0, last]

    def window(ids):  # every position, padded after the last (causal: the padding is never seen)
        padded = np.zeros((1, positions), np.int32)
        padded[0, :len(ids)] = ids
        return put(padded)

    cached = hasattr(nnx.merge(graphdef, params), "decode")
    ids = list(prompt_ids)
    if cached:
        logits_V, caches = prefill(params, put(np.asarray([prompt_ids], np.int32)))
    else:
        logits_V = recompute(params, window(ids), len(ids) - 1)
    key = jax.random.PRNGKey(seed)
    for index in range(new_tokens):
        token = int(choose(logits_V, jax.random.fold_in(key, index)))
        ids.append(token)
        if token in stop_ids or index == new_tokens - 1:
            break
        if cached:
            logits_V, caches = step(params, put(np.asarray([[token]], np.int32)), caches)
        else:
            logits_V = recompute(params, window(ids), len(ids) - 1)
    return ids


def sample_text(graphdef: nnx.GraphDef, params, cfg: ModelConfig, prompt: str, new_tokens: int,
                codec: TextCodec | None = None, placement: jax.sharding.Sharding | None = None) -> str:
    """The greedy continuation of `prompt` as text, at most as long as one training sequence
    (model.seq_len positions, prompt included); `codec` turns text into ids and back (default:
    UTF-8 bytes)."""
    codec = codec or TextCodec()
    prompt_ids = codec.encode(prompt)[-cfg.seq_len + 1:]
    room = min(new_tokens, cfg.seq_len - len(prompt_ids))
    return codec.decode(generate_ids(graphdef, params, cfg, prompt_ids, room, placement=placement))
