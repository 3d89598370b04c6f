"""A decoder-only transformer with its layers stacked on a leading 'layers' axis and scanned."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config.model import ModelConfig
from jaxpar.model.adapters import freeze
from jaxpar.model.attention import Attention, KVCache
from jaxpar.model.axes import column_parallel, constrain, param, vocab_lookup
from jaxpar.model.layers import RMSNorm
from jaxpar.model.mla import LatentAttention, LatentCache
from jaxpar.model.mlp import MLP
from jaxpar.model.moe import MoE
from jaxpar.model.mtp import MTPModule, mtp_weight
from jaxpar.model.routing_trace import RoutingTrace
from jaxpar.model.segments import Segments


class Block(nnx.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (the MLP may be an MoE); with
    model.sandwich_norm, each sublayer's output is normalized too before it joins the residual (Gemma).
    `local`: its attention looks through model.window (the layer's kind in model.attention_pattern).

    Returns the new residual stream and routing statistics ({} for a dense MLP).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False, local: bool = False):
        norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.norm_offset)  # noqa: E731
        self.attn_norm = norm()
        self.attn = (LatentAttention if cfg.mla.enabled else Attention)(cfg, rngs=rngs, local=local)
        self.attn_post_norm = norm() if cfg.sandwich_norm else None
        self.mlp_norm = norm()
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
        self.mlp_post_norm = norm() if cfg.sandwich_norm else None

    def __call__(self, x_BLD: jax.Array, noise_B: jax.Array | None = None, segments: Segments | None = None,
                 routing: RoutingTrace | None = None):
        y_BLD = _post(self.attn_post_norm, self.attn(self.attn_norm(x_BLD), segments, noise_B))
        return self._feed_forward(x_BLD + y_BLD, noise_B, routing)

    def decode(self, x_BLD: jax.Array, cache: KVCache):
        """The block on the next positions with its attention's key/value cache: (x, cache)."""
        y_BLD, cache = self.attn.decode(self.attn_norm(x_BLD), cache)
        return self._feed_forward(x_BLD + _post(self.attn_post_norm, y_BLD), None, None)[0], cache

    def _feed_forward(self, x_BLD: jax.Array, noise_B: jax.Array | None, routing: RoutingTrace | None):
        if isinstance(self.mlp, MoE):
            y_BLD, stats = self.mlp(self.mlp_norm(x_BLD), noise_B, routing)
            return x_BLD + _post(self.mlp_post_norm, y_BLD), stats
        return x_BLD + _post(self.mlp_post_norm, self.mlp(self.mlp_norm(x_BLD), noise_B)), {}


def _post(norm: RMSNorm | None, y_BLD: jax.Array) -> jax.Array:
    """A sublayer's output, normalized where the block has sandwich norms."""
    return y_BLD if norm is None else norm(y_BLD)


class LayerUnit(nnx.Module):
    """The scanned unit when layers differ: model.unit_blocks blocks, one period of the MoE layers
    (every moe.every-th block holds the experts) and of the local and global attention pattern, so
    each block's kind is fixed. Its routing statistics are the sums over its MoE blocks."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, rngs=rngs, moe=cfg.block_is_moe(j), local=cfg.layer_is_local(j))
                                for j in range(cfg.unit_blocks)])

    def __call__(self, x_BLD: jax.Array, noise_B: jax.Array | None = None, segments: Segments | None = None,
                 routing: RoutingTrace | None = None):
        stats, moe_seen = {}, 0
        for block in self.blocks:
            traced = None
            if routing is not None and isinstance(block.mlp, MoE):  # the trace's layers are the MoE layers
                traced = routing.after(moe_seen)
            x_BLD, block_stats = block(x_BLD, noise_B, segments, traced)
            if block_stats:
                moe_seen += 1
                stats = jax.tree.map(jnp.add, stats, block_stats) if stats else block_stats
        return x_BLD, stats

    def decode(self, x_BLD: jax.Array, caches: tuple[KVCache, ...]):
        """The unit's blocks on the next positions, each with its own key/value cache."""
        updated = []
        for block, cache in zip(self.blocks, caches):
            x_BLD, cache = block.decode(x_BLD, cache)
            updated.append(cache)
        return x_BLD, tuple(updated)


class Transformer(nnx.Module):
    """Token embedding, optional learned positions, scanned blocks, final norm, (tied) logits.

    Call with int tokens (B, L); returns fp32 logits (B, L, V), V the padded vocabulary
    (`model.vocab_multiple`), whose padded columns hold the lowest float and so never win.
    """

    # Where the stacked layers live in the parameter state: a layer's weights inside the layer
    # scan are the slices of the weights below this path.
    STACKED_AT = ("blocks",)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        V, D = cfg.padded_vocab, cfg.d_model
        self.vocab_size = cfg.vocab_size
        self.embedding = param(rngs.params(), (V, D), ("vocab", "embed"), 0.02)
        self.pos_embedding = (
            param(rngs.params(), (cfg.seq_len, D), ("pos", "embed"), 0.02) if cfg.positions == "learned" else None
        )

        unit = LayerUnit if cfg.has_layer_units else functools.partial(Block, local=cfg.layer_is_local(0))
        self.blocks = _stacked(cfg.units, lambda r: unit(cfg, rngs=r), rngs)
        # DeepSeek-V3's first layers: dense blocks of their own stack, run before the units
        self.dense_blocks = (_stacked(cfg.moe.first_dense, lambda r: Block(cfg, rngs=r), rngs)
                             if cfg.moe.first_dense else None)
        self.blocks_per_unit = cfg.unit_blocks
        self.moe_blocks_per_unit = max(cfg.moe_blocks_per_unit, 1)
        self.embed_scale = cfg.d_model ** 0.5 if cfg.embed_scale else None
        self.final_softcap = cfg.final_softcap
        self.final_norm = RMSNorm(D, cfg.norm_eps, offset=cfg.norm_offset)
        self.head = None if cfg.tie_embeddings else param(rngs.params(), (D, V), ("embed", "vocab"), D ** -0.5)
        self.mtp = (nnx.List([MTPModule(cfg, Block(cfg, rngs=rngs), rngs=rngs) for _ in range(cfg.mtp.depth)])
                    if cfg.mtp.depth else None)
        self.mtp_weight = mtp_weight(cfg)
        if cfg.lora.enabled:  # only the adapters train
            freeze(self, cfg.lora)

    def __call__(self, tokens_BL: jax.Array, segments: Segments | None = None) -> jax.Array:
        """Logits of the tokens; with `segments`, of each packed document as if it ran alone."""
        positions = 0 if segments is None else segments.positions_BL
        return self.logits(self.run_blocks(self.embed(tokens_BL, positions), segments=segments)[0])

    def stacked_layers(self) -> int:
        """How many layers are stacked (scanned units: blocks, or units of model.unit_blocks blocks)."""
        return stacked_layers(nnx.state(self.blocks))

    def embed(self, tokens_BL: jax.Array, first_position: jax.Array | int = 0) -> jax.Array:
        """Token (and learned position) embedding: (B, L) ints -> (B, L, D); the tokens sit at
        positions first_position ... first_position + L - 1, or, given a (B, L) array of positions
        (a packed row's), at those."""
        # The tokens stay whole along the sequence: sharding them like the residual stream would make
        # the partitioner shift their halo (the T -> L slice) with a collective-permute.
        tokens_BL = constrain(tokens_BL, ("batch", "seq"))
        # The lookup as tensor parallelism does it (each rank its vocabulary rows, then a sum), and
        # only then split along the sequence: asked for split output directly, the partitioner
        # gathers the whole vocabulary-split table instead.
        x_BLD = constrain(vocab_lookup(self.embedding[...], tokens_BL), ("batch", "seq", "embed"))
        if self.embed_scale is not None:  # Gemma: sqrt(d_model) rounded to the compute dtype, as transformers does
            x_BLD = x_BLD * jnp.asarray(self.embed_scale, x_BLD.dtype)
        x_BLD = constrain(x_BLD, ("batch", "residual_seq", "embed"))
        if self.pos_embedding is not None:
            if jnp.ndim(first_position) == 2:
                positions_BLD = jnp.take(self.pos_embedding[...], first_position, axis=0)
            else:
                positions_BLD = jax.lax.dynamic_slice_in_dim(self.pos_embedding[...], first_position,
                                                             tokens_BL.shape[1])[None]
            x_BLD = x_BLD + positions_BLD
            x_BLD = constrain(x_BLD, ("batch", "residual_seq", "embed"))
        return x_BLD

    def logits(self, x_BLD: jax.Array) -> jax.Array:
        """Final norm and output projection (tied to the embedding unless untied): -> (B, L, V) fp32
        logits, accumulated in fp32 whatever the compute dtype (the loss's softmax needs them)."""
        return self.project(self.final_norm(x_BLD))

    def project(self, x_BLD: jax.Array) -> jax.Array:
        """The output projection of normalized hidden states (logits' second half; multi-token prediction
        normalizes its own): -> (B, L, V) fp32 logits, padded columns at the lowest float."""
        residual, names = ("batch", "residual_seq", "embed"), ("batch", "seq", "vocab")
        if self.head is None:
            logits_BLV = column_parallel("BLD,VD->BLV", x_BLD, self.embedding, residual, names, jnp.float32)
        else:
            logits_BLV = column_parallel("BLD,DV->BLV", x_BLD, self.head, residual, names, jnp.float32)
        if self.final_softcap:
            logits_BLV = self.final_softcap * jnp.tanh(logits_BLV / self.final_softcap)
        if logits_BLV.shape[-1] > self.vocab_size:  # padded rows: never the target, never the argmax
            real_V = jnp.arange(logits_BLV.shape[-1]) < self.vocab_size
            logits_BLV = jnp.where(real_V, logits_BLV, jnp.finfo(logits_BLV.dtype).min)
        return constrain(logits_BLV, names)

    def decode(self, tokens_BL: jax.Array, caches) -> tuple[jax.Array, object]:
        """Logits (B, L, V) of the next L tokens, given the key/value caches of what came before
        (`empty_caches`), and the caches with these tokens added."""
        L = tokens_BL.shape[1]
        first = _first_cache(caches)
        x_BLD = self.embed(tokens_BL, first.positions_BL(L))
        if self.dense_blocks is not None:
            x_BLD, dense = _decode_stack(self.dense_blocks, x_BLD, caches.dense, first, L)
            x_BLD, blocks = _decode_stack(self.blocks, x_BLD, caches.blocks, first, L)
            return self.logits(x_BLD), PrefixedCaches(dense, blocks)
        x_BLD, caches = _decode_stack(self.blocks, x_BLD, caches, first, L)
        return self.logits(x_BLD), caches

    def empty_caches(self, cfg: ModelConfig, batch: int, positions: int, dtype=jnp.float32,
                     starts_B: jax.Array | None = None):
        """Key/value caches for `positions` slots, stacked like the layers: a KVCache per block, a tuple
        of them per unit of several blocks. starts_B: each row's first slot (left-padded prompts; 0)."""
        one = (LatentCache if cfg.mla.enabled else KVCache).empty(batch, positions, cfg, dtype, starts_B)
        stack = lambda n: jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), one)  # noqa: E731
        units = self.stacked_layers()
        blocks = stack(units)
        if isinstance(self.blocks, LayerUnit):
            blocks = tuple(stack(units) for _ in range(self.blocks_per_unit))
        if self.dense_blocks is None:
            return blocks
        return PrefixedCaches(stack(stacked_layers(nnx.state(self.dense_blocks))), blocks)

    def run_blocks(self, x_BLD: jax.Array, scan: LayerScan | None = None, layer_ids: jax.Array | None = None,
                   noise_B: jax.Array | None = None, segments: Segments | None = None,
                   routing: RoutingTrace | None = None):
        """Run the stacked blocks; returns the output and per-layer routing statistics stacked on
        a leading axis ({} for a dense model).

        scan(one_layer, x_BLD, stacked_state, layer_ids) -> (x_BLD, stats) runs
        one_layer(x_BLD, layer_state, layer_id) -> (x_BLD, stats) over the stacked layers; the
        default is a plain `lax.scan` (compile time does not grow with depth). The step passes its
        own to add rematerialization and to expand sharded weights layer by layer.
        layer_ids: each stacked layer's index in model order (default 0, 1, ...).
        noise_B (training only): a PRNG key per batch row, folded with the layer id, for noisy
        top-k routing: noise keyed by the row, not by the device or microbatch that holds it.
        segments: the documents of packed rows (jaxpar.model.segments); None: one per row.
        routing: to trace (and replay) routing token by token (jaxpar.model.routing_trace; verify only).
        """
        graphdef, stacked = nnx.split(self.blocks)
        ids = jnp.arange(stacked_layers(stacked)) if layer_ids is None else layer_ids

        def one_layer(x_BLD, layer_state, layer_id):
            traced = None if routing is None else routing.at_layer(layer_id * self.moe_blocks_per_unit)
            return nnx.merge(graphdef, layer_state)(x_BLD, _layer_keys(noise_B, layer_id), segments, traced)

        if self.dense_blocks is not None:  # not pipelined (refused): every run of the blocks starts with them
            x_BLD = self._run_dense_blocks(x_BLD, noise_B, segments)
        return (scan or plain_scan)(one_layer, x_BLD, stacked, ids)

    def _run_dense_blocks(self, x_BLD: jax.Array, noise_B: jax.Array | None, segments: Segments | None):
        """The dense first layers (model.moe.first_dense), by a plain scan: the layout's layer-by-layer
        weight gathering and remat policy apply to the units alone. Their rows' keys fold in ids after
        the units', so no two layers share one."""
        graphdef, stacked = nnx.split(self.dense_blocks)
        first_id = self.stacked_layers()

        def one_layer(x_BLD, layer_state, layer_id):
            return nnx.merge(graphdef, layer_state)(x_BLD, _layer_keys(noise_B, layer_id), segments, None)[0], None

        return plain_scan(one_layer, x_BLD, stacked, first_id + jnp.arange(stacked_layers(stacked)))[0]


# scan(one_layer, x_BLD, stacked_state, layer_ids) -> (x_BLD, per-layer stats): see run_blocks.
LayerScan = Callable[[Callable, jax.Array, object, jax.Array], tuple]


def plain_scan(one_layer: Callable, x_BLD: jax.Array, stacked, layer_ids: jax.Array):
    """A `lax.scan` of one_layer over the stacked layers, nothing kept or redone specially."""
    return jax.lax.scan(lambda x, layer: one_layer(x, *layer), x_BLD, (stacked, layer_ids))


def _layer_keys(noise_B: jax.Array | None, layer_id: jax.Array) -> jax.Array | None:
    """Each row's key for one layer: the row's key with the layer id folded in (None without keys)."""
    return None if noise_B is None else jax.vmap(lambda k: jax.random.fold_in(k, layer_id))(noise_B)


def _write_new_slots(caches, layer_caches, index: jax.Array, start: jax.Array, new: int):
    """The stacked caches with layer `index`'s slots start ... start + new taken from its updated caches
    (and their lengths advanced)."""
    def write(stacked_a, layer_a):
        if stacked_a.ndim < 4:  # lengths and starts: the layer's own
            return jax.lax.dynamic_update_index_in_dim(stacked_a, layer_a, index, 0)
        fresh = jax.lax.dynamic_slice_in_dim(layer_a, start, new, axis=1)
        at = (index, jnp.zeros((), jnp.int32), start) + (jnp.zeros((), jnp.int32),) * (stacked_a.ndim - 3)
        return jax.lax.dynamic_update_slice(stacked_a, fresh[None], at)

    return jax.tree.map(write, caches, layer_caches)


def _first_cache(caches) -> KVCache:
    """The first layer's cache (every layer's holds as many positions, from the same starts)."""
    first = caches.dense if isinstance(caches, PrefixedCaches) else caches
    first = first[0] if isinstance(first, tuple) else first
    return jax.tree.map(lambda a: a[0], first)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixedCaches:
    """The caches of a model with dense first layers (model.moe.first_dense): theirs, then the units'."""
    dense: object
    blocks: object


def _stacked(count: int, make: Callable, rngs: nnx.Rngs):
    """`count` modules make(rngs) stacked on a leading 'layers' axis, each from its own split of rngs."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs):
        return make(rngs)

    return build(rngs)


def _decode_stack(blocks, x_BLD: jax.Array, caches, first: KVCache, new: int):
    """A stack of blocks (or units) on the next `new` positions with its stacked caches: (x, caches).
    The caches ride in the carry, and each layer writes back only its new slots: as the scan's input
    and output they would be copied whole at every token."""
    graphdef, stacked = nnx.split(blocks)

    def one_unit(carry, unit):
        x_BLD, caches = carry
        layer_state, index = unit
        mine = jax.tree.map(lambda a: a[index], caches)
        x_BLD, mine = nnx.merge(graphdef, layer_state).decode(x_BLD, mine)
        return (x_BLD, _write_new_slots(caches, mine, index, first.length, new)), None

    layers = jnp.arange(stacked_layers(stacked))
    return jax.lax.scan(one_unit, (x_BLD, caches), (stacked, layers))[0]


def stacked_layers(stacked) -> int:
    """Number of layers in a stacked state (its leading dimension)."""
    return jax.tree.leaves(stacked)[0].shape[0]
