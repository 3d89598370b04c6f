"""A decoder-only transformer with its layers stacked on a leading 'layers' axis and scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.attention import Attention
from jaxpar.model.axes import constrain, param
from jaxpar.model.layers import RMSNorm
from jaxpar.model.mlp import MLP


class Block(nnx.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class Transformer(nnx.Module):
    """Token embedding, optional learned positions, scanned blocks, final norm, (tied) logits.

    Call with int tokens (B, L); returns logits (B, L, V) in the parameters' dtype.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        V, D = cfg.vocab_size, cfg.d_model
        self.embedding = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        self.pos_embedding = (
            param(rngs.params(), (cfg.seq_len, D), ("pos", "embed"), 0.02) if cfg.positions == "learned" else None
        )

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = RMSNorm(D)
        self.head = None if cfg.tie_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), D ** -0.5)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        table_VD = self.embedding[...]
        x_BLD = constrain(jnp.take(table_VD, tokens_BL, axis=0), ("batch", "seq", "embed"))
        if self.pos_embedding is not None:
            x_BLD = x_BLD + self.pos_embedding[...][: tokens_BL.shape[1]][None]
        x_BLD = self.run_blocks(x_BLD)
        x_BLD = self.final_norm(x_BLD)
        if self.head is None:
            logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD, table_VD)
        else:
            logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, self.head[...])
        return constrain(logits_BLV, ("batch", "seq", "vocab"))

    def run_blocks(self, x_BLD: jax.Array) -> jax.Array:
        """Scan the stacked blocks so compile time does not grow with depth."""
        graphdef, stacked = nnx.split(self.blocks)

        def one_layer(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x), None

        x_BLD, _ = jax.lax.scan(one_layer, x_BLD, stacked)
        return x_BLD
