"""Multi-token prediction (DeepSeek-V3; model.mtp): D sequential modules after the last block, module
k predicting the token k + 1 positions after the next one.

Module k takes the hidden states h_{k-1} (h_0: the last block's output after the final norm, as
transformers and vLLM hand DeepSeek-V3's module the model's last hidden state) and
the embeddings of the tokens k positions ahead, normalizes each, projects their concatenation
[norm(emb(t_{i+k})); norm(h_{k-1})_i] back to the model width, and runs one transformer block:
h_k. Its logits are the shared output head's (tied: the embedding) on norm_k(h_k), and its loss is
the cross-entropy of token t_{i+k+1} at every position i where that token exists (the last k
positions of a row have none). The modules' mean loss times model.mtp.weight joins the objective.
Generation and export ignore the modules: they train the trunk's representations.
Shape legend: B batch, L positions, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.model import ModelConfig
from jaxpar.model.axes import constrain, param
from jaxpar.model.cross_entropy import token_cross_entropy
from jaxpar.model.layers import RMSNorm

RESIDUAL = ("batch", "residual_seq", "embed")


class MTPModule(nnx.Module):
    """One depth of multi-token prediction: the two norms, the projection, a block and the output norm.
    block: a dense transformer block (jaxpar.model.transformer.Block) built by the caller."""

    def __init__(self, cfg: ModelConfig, block: nnx.Module, *, rngs: nnx.Rngs):
        D = cfg.d_model
        norm = lambda: RMSNorm(D, cfg.norm_eps, offset=cfg.norm_offset)  # noqa: E731
        self.embed_norm, self.hidden_norm, self.out_norm = norm(), norm(), norm()
        # slot 0 takes the embeddings, slot 1 the hidden states (DeepSeek's eh_proj, split in two)
        self.w_proj = param(rngs.params(), (2, D, D), (None, "embed", "mlp"), (2 * D) ** -0.5)
        self.block = block

    def __call__(self, h_BLD: jax.Array, e_BLD: jax.Array) -> jax.Array:
        """h_k from h_{k-1} and the embeddings of the tokens k ahead."""
        w = self.w_proj[...].astype(h_BLD.dtype)
        x_BLD = (jnp.einsum("BLD,DE->BLE", self.embed_norm(e_BLD), w[0])
                 + jnp.einsum("BLD,DE->BLE", self.hidden_norm(h_BLD), w[1]))
        return self.block(constrain(x_BLD, RESIDUAL))[0]


def mtp_loss(model, h_BLD: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """The mean over the modules of each one's mean cross-entropy (0 without modules), from the last
    block's output h_BLD. tokens_BT: the rows' L + 1 tokens (inputs and the last target)."""
    modules = model.mtp
    h_BLD = model.final_norm(h_BLD)
    L = h_BLD.shape[1]
    total = jnp.zeros((), jnp.float32)
    for k, module in enumerate(modules, start=1):
        ahead_BL = jnp.pad(tokens_BT[:, k:], ((0, 0), (0, k - 1)))  # token i + k at position i (0 past the row)
        h_BLD = module(h_BLD, model.embed(ahead_BL))
        targets_BL = jnp.pad(tokens_BT[:, k + 1:], ((0, 0), (0, k)))  # token i + k + 1 at position i
        logits_BLV = model.project(module.out_norm(h_BLD))
        losses_BL = token_cross_entropy(logits_BLV, targets_BL)
        counted_L = (jnp.arange(L) < L - k).astype(jnp.float32)  # the last k positions have no target
        total = total + jnp.mean(losses_BL * counted_L) * (L / (L - k))
    return total / max(len(modules), 1)


def mtp_weight(cfg: ModelConfig) -> float:
    """The MTP loss's weight in the objective (0 without modules)."""
    return cfg.mtp.weight if cfg.mtp.depth else 0.0
