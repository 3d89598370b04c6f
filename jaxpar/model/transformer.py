"""A decoder-only transformer with its layers stacked on a leading 'layers' axis and scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.model.attention import Attention
from jaxpar.model.axes import constrain, layer_weights, layer_weights_policy, param
from jaxpar.model.layers import RMSNorm
from jaxpar.model.mlp import MLP
from jaxpar.model.moe import MoE


class Block(nnx.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (the MLP may be an MoE).

    Returns the new residual stream and routing statistics ({} for a dense MLP).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)

    def __call__(self, x_BLD: jax.Array, noise_key: jax.Array | None = None):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        if isinstance(self.mlp, MoE):
            y_BLD, stats = self.mlp(self.mlp_norm(x_BLD), noise_key)
            return x_BLD + y_BLD, stats
        return x_BLD + self.mlp(self.mlp_norm(x_BLD)), {}


class MoEUnit(nnx.Module):
    """The scanned unit of an MoE model: `every - 1` dense blocks, then one MoE block."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        every = cfg.moe.every
        self.blocks = nnx.List([Block(cfg, rngs=rngs, moe=i == every - 1) for i in range(every)])

    def __call__(self, x_BLD: jax.Array, noise_key: jax.Array | None = None):
        stats = {}
        for block in self.blocks:
            x_BLD, block_stats = block(x_BLD, noise_key)
            stats = block_stats or stats
        return x_BLD, stats


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

        unit, units = (MoEUnit, cfg.n_layers // cfg.moe.every) if cfg.moe.experts else (Block, cfg.n_layers)

        @nnx.split_rngs(splits=units)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs):
            return unit(cfg, rngs=rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = RMSNorm(D)
        self.head = None if cfg.tie_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), D ** -0.5)

    def __call__(self, tokens_BL: jax.Array, remat: str = "none") -> jax.Array:
        return self.logits(self.run_blocks(self.embed(tokens_BL), remat)[0])

    def embed(self, tokens_BL: jax.Array) -> jax.Array:
        """Token (and learned position) embedding: (B, L) ints -> (B, L, D)."""
        x_BLD = constrain(jnp.take(self.embedding[...], tokens_BL, axis=0), ("batch", "seq", "embed"))
        if self.pos_embedding is not None:
            x_BLD = x_BLD + self.pos_embedding[...][: tokens_BL.shape[1]][None]
        return x_BLD

    def logits(self, x_BLD: jax.Array) -> jax.Array:
        """Final norm and output projection (tied to the embedding unless untied): -> (B, L, V)."""
        x_BLD = self.final_norm(x_BLD)
        if self.head is None:
            logits_BLV = jnp.einsum("BLD,VD->BLV", x_BLD, self.embedding[...])
        else:
            logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, self.head[...])
        return constrain(logits_BLV, ("batch", "seq", "vocab"))

    def run_blocks(self, x_BLD: jax.Array, remat: str = "none", noise_key: jax.Array | None = None):
        """Scan the stacked blocks so compile time does not grow with depth; returns the output
        and per-layer routing statistics stacked on a leading axis ({} for a dense model).
        `noise_key` (training only) drives noisy top-k routing, folded with the layer index.

        remat: 'none' keeps every activation for backward; 'full' keeps only each layer's
        input and recomputes the layer; 'dots' keeps matmul outputs only; 'sqrt' splits the
        L layers into about sqrt(L) segments (the last one shorter when they do not divide L),
        keeps segment inputs and recomputes a whole segment in backward (a nested scan):
        O(sqrt L) activation memory. When the layout
        expands weights per layer (ZeRO-2/3), the expanded weights are fetched again in
        backward rather than kept, so about one layer's full weights exist at a time.
        """
        graphdef, stacked = nnx.split(self.blocks)
        n_layers = len_layers(stacked)

        def one_layer(x, layer):
            layer_state, index = layer
            key = None if noise_key is None else jax.random.fold_in(noise_key, index)
            return nnx.merge(graphdef, layer_weights(layer_state, index))(x, key)

        policy = REMAT_POLICIES.get(remat) or layer_weights_policy()
        if policy is not None:
            one_layer = jax.checkpoint(one_layer, policy=policy, prevent_cse=False)
        layers = (stacked, jnp.arange(n_layers))
        if remat == "sqrt":
            return _segmented_scan(one_layer, x_BLD, layers, sqrt_segment_size(n_layers))
        return jax.lax.scan(one_layer, x_BLD, layers)


# Per-layer checkpoint policies; 'sqrt' checkpoints whole segments instead (see _segmented_scan).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def len_layers(stacked) -> int:
    """Number of layers in a stacked state (its leading dimension)."""
    return jax.tree.leaves(stacked)[0].shape[0]


def sqrt_segment_size(n_layers: int) -> int:
    """Layers per remat segment: round(sqrt(L)), so there are about sqrt(L) segments. When it
    does not divide L (a prime L such as 7, 11, 13), the last segment is shorter."""
    return max(1, round(n_layers ** 0.5))


def _segmented_scan(one_layer, x_BLD, layers, size: int):
    """Checkpointed segments of `size` layers (only each segment's input is kept): an outer scan
    over the full segments, each an inner scan over its layers, then a shorter last segment."""
    n_layers = len_layers(layers)
    full, rest = divmod(n_layers, size)

    @jax.checkpoint
    def one_segment(x, segment_layers):
        return jax.lax.scan(one_layer, x, segment_layers)

    head = jax.tree.map(lambda a: a[:full * size].reshape(full, size, *a.shape[1:]), layers)
    x_BLD, stats = jax.lax.scan(one_segment, x_BLD, head)
    stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
    if rest:
        x_BLD, tail_stats = one_segment(x_BLD, jax.tree.map(lambda a: a[full * size:], layers))
        stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, tail_stats)
    return x_BLD, stats
