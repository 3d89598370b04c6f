"""Greedy text generation, so a user can see what the model learned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.data.token_folder import TextCodec


def greedy_sample(graphdef: nnx.GraphDef, params: nnx.State, prompt: str, new_tokens: int, seq_len: int,
                  window_sharding: jax.sharding.Sharding | None = None, codec=None) -> str:
    """Extend a prompt by `new_tokens` argmax steps over a sliding seq_len window; `codec` turns
    text into token ids and back (default: UTF-8 bytes).

    With `window_sharding` (replicated on the weights' mesh) the window is placed there, which
    a multi-process run needs: every process then runs the same program on the same prompt.
    """

    @jax.jit
    def next_token(params, window_1L, position):
        logits_LV = nnx.merge(graphdef, params)(window_1L)[0]
        return jnp.argmax(logits_LV[position])

    codec = codec or TextCodec()
    tokens = codec.encode(prompt)
    for _ in range(new_tokens):
        window = tokens[-seq_len:]
        padded = np.zeros((1, seq_len), np.int32)  # causal: padding after `position` is never seen
        padded[0, : len(window)] = window
        if window_sharding is not None:
            padded = jax.device_put(padded, window_sharding)
        tokens.append(int(next_token(params, padded, len(window) - 1)))
    return codec.decode(tokens)
