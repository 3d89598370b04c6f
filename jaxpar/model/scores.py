"""What attention does to its scores besides the causal softmax, in one place for the dot, flash and
context kernels: a sliding window (model.window), a soft cap (model.attn_softcap), the scale
(model.attn_scale) and sinks (model.sinks).

- scale: the logits are q.k times `scale` (default 1 / sqrt(head size)).
- soft cap (Gemma 2): the scaled scores s become cap * tanh(s / cap), before any mask.
- window (Mistral, Gemma, gpt-oss local layers): query q sees key k iff 0 <= q - k < window.
- sinks (gpt-oss): a learned logit per query head joins every row's softmax as one more column
  whose value is zero, so it takes a share of the probability and adds nothing to the output.
  Blockwise kernels fold it in once, into each row's final log-sum-exp: lse' = logaddexp(lse, sink),
  out' = out * exp(lse - lse'). Backward then recomputes the probabilities from lse' as usual, the
  softmax term D = rowsum(dO * O') is unchanged (the sink's value is zero), and the sink's own
  gradient is -sum over rows of exp(sink - lse') * D.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # annotations only
    from jaxpar.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    """Static score modifications of one attention layer (hashable: a jit and custom_vjp constant)."""

    window: int = 0  # a query sees itself and the window - 1 keys before it; 0: every earlier key
    softcap: float = 0.0  # scores squashed to softcap * tanh(s / softcap); 0: off
    scale: float = 0.0  # what q.k is multiplied by; 0: 1 / sqrt(head size)

    @staticmethod
    def of(cfg: ModelConfig, local: bool = False) -> ScoreOptions:
        """A layer's options: the window where the layer is local (ModelConfig.layer_is_local)."""
        return ScoreOptions(cfg.window if local else 0, float(cfg.attn_softcap), float(cfg.attn_scale))

    def scale_for(self, head_size: int) -> float:
        return self.scale or 1.0 / math.sqrt(head_size)

    def logits(self, qk: jax.Array, head_size: int) -> jax.Array:
        """fp32 q.k -> the logits the softmax takes (scaled, then capped), before any mask."""
        s = qk * self.scale_for(head_size)
        return self.softcap * jnp.tanh(s / self.softcap) if self.softcap else s

    def logits_grad(self, dlogits: jax.Array, logits: jax.Array, head_size: int) -> jax.Array:
        """The gradient of q.k from that of the (unmasked) logits: through tanh (1 - tanh^2), and the scale."""
        if self.softcap:
            t = logits / self.softcap
            dlogits = dlogits * (1.0 - t * t)
        return dlogits * self.scale_for(head_size)

    def sees(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """(..., Lq, Lk) bools from positions (..., Lq) and (..., Lk): causal, and inside the window."""
        offset = q_pos[..., :, None] - k_pos[..., None, :]
        visible = offset >= 0
        return visible & (offset < self.window) if self.window else visible


PLAIN = ScoreOptions()  # causal attention scaled by 1 / sqrt(head size), nothing else


def masked(logits: jax.Array, visible: jax.Array | None) -> jax.Array:
    """-inf where a key is not visible (None: all are)."""
    return logits if visible is None else jnp.where(visible, logits, -jnp.inf)


def fold_sinks(lse: jax.Array, sinks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weight, lse'): a row's softmax over its keys joined by its sink logit (broadcast like lse); the
    output over the keys alone is multiplied by weight. A row that saw no key (lse -inf) gets weight 0."""
    folded = jnp.logaddexp(lse, sinks.astype(jnp.float32))
    return jnp.exp(lse - folded), folded


def sink_share(lse: jax.Array, sinks: jax.Array, delta: jax.Array) -> jax.Array:
    """Each row's part of the sinks' gradient, -p_sink * D, with lse the folded log-sum-exp and delta
    D = rowsum(dO * O); summed over the rows (and context ranks) by the caller."""
    return -jnp.exp(sinks.astype(jnp.float32) - lse) * delta
