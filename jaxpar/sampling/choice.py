"""The next token of each row from its logits: greedy, or drawn from softmax(logits / temperature)
over the top-k and then the top-p (nucleus) of the vocabulary.

Every draw takes a key of its own, folded from the seed with the row's id and the step: not the
device or the batch that holds the row, so that the same prompt draws the same tokens on every
layout and in any batch (a row's id is its prompt's index, and a completion's within its group).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.errors import UserError
from jaxpar.sampling.command import MAX_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy; top_k 0: the whole vocabulary; top_p 1: no nucleus cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self, vocab_size: int) -> None:
        """One sentence for a setting out of range."""
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise UserError(f"the temperature must be between 0 (greedy) and {MAX_TEMPERATURE:g}, "
                            f"got {self.temperature}.")
        if not 0 <= self.top_k <= vocab_size:
            raise UserError(f"top_k must be between 0 (the whole vocabulary) and the vocabulary's {vocab_size}, "
                            f"got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}.")


def row_keys(seed: int, rows_B: jax.Array, step: jax.Array) -> jax.Array:
    """A PRNG key per row for draw number `step`: the seed's key folded with the row id, then the step."""
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda row: jax.random.fold_in(jax.random.fold_in(base, row), step))(rows_B)


def _top_k(logits_BV: jax.Array, k: int) -> jax.Array:
    """The logits with all but each row's k largest set to the lowest float (ties at the k-th kept)."""
    kth_B1 = jax.lax.top_k(logits_BV, k)[0][:, -1:]
    return jnp.where(logits_BV >= kth_B1, logits_BV, jnp.finfo(logits_BV.dtype).min)


def _top_p(scaled_BV: jax.Array, p: float) -> jax.Array:
    """The tempered logits with all but the nucleus set to the lowest float: the fewest most likely
    tokens whose probabilities sum to at least p (the most likely always kept; ties at the edge kept)."""
    sorted_BV = jnp.sort(scaled_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # the mass of the tokens ranked above
    kept_BV = before_BV < p
    edge_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled_BV >= edge_B1, scaled_BV, jnp.finfo(scaled_BV.dtype).min)


def choose(logits_BV: jax.Array, sampling: Sampling, keys_B: jax.Array) -> jax.Array:
    """Each row's next token (B,) int32 from its fp32 logits (B, V)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if sampling.top_k:
        logits_BV = _top_k(logits_BV, sampling.top_k)
    scaled_BV = logits_BV / sampling.temperature
    if sampling.top_p < 1:
        scaled_BV = _top_p(scaled_BV, sampling.top_p)
    return jax.vmap(jax.random.categorical)(keys_B, scaled_BV).astype(jnp.int32)
