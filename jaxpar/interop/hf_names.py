"""Which Hugging Face tensors each jaxpar parameter is made of, and how: one table, read both ways.

A Hugging Face linear layer stores (out, in) with the heads flattened into `out`; jaxpar stores
(in, ..., out) with heads as their own dimension, Q/K/V (and SwiGLU's gate/up) fused into slots,
every layer stacked on a leading axis, and a mixture of experts' weights with an expert axis next
(where Mixtral and Qwen3-MoE store one tensor per expert). A `TensorMap` says it as data: the source
tensors (one per slot), how each is reshaped (`split`) and transposed (`perm`) into one slot of one
layer (and expert), the axis the slots stack on, the vocabulary padding, and which checkpoint layer
each stacked one is (an MoE model's scanned unit holds `every` blocks). From that, `read` takes any
box of the jaxpar parameter (a device's shard) and reads just the rows and columns of the source
tensors inside it, and `to_sources` turns one layer (and expert) of a parameter back into the
tensors a checkpoint stores.

Pure NumPy: the checks before compiling and the export use it without jax.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxpar.config import ModelConfig

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One jaxpar parameter as Hugging Face tensors.

    sources: one name per slot ("{layer}" stands for the checkpoint's layer index when stacked,
    "{expert}" for the expert's); each has `source_shape`, is reshaped to `split` and transposed by
    `perm` into one slot of one layer (and expert); no sources: a parameter the checkpoint does not
    have, read as zeros and not written (noisy top-k's noise weight, unused with the noise off);
    slot_axis: where the slots stack in one layer's (expert's) jaxpar shape (None: one source); pad:
    (axis of that shape, rows in the checkpoint, rows in jaxpar) for a padded vocabulary; experts: an
    expert axis of this size after the layer axis (0: none); stacked layer i is the checkpoint's
    layer i x layer_step + layer_offset.
    """

    path: tuple[str, ...]
    sources: tuple[str, ...]
    source_shape: tuple[int, ...]
    split: tuple[int, ...]
    perm: tuple[int, ...]
    layers: int = 0  # stacked over this many layers (0: not stacked)
    slot_axis: int | None = None
    pad: tuple[int, int, int] | None = None
    experts: int = 0
    layer_step: int = 1
    layer_offset: int = 0

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """One slot of one layer, in jaxpar's order, padded."""
        shape = [self.split[p] for p in self.perm]
        if self.pad is not None:
            shape[self.pad[0]] = self.pad[2]
        return tuple(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        """The whole jaxpar parameter."""
        piece = list(self.piece_shape)
        if self.slot_axis is not None:
            piece.insert(self.slot_axis, len(self.sources))
        return ((self.layers,) if self.layers else ()) + ((self.experts,) if self.experts else ()) + tuple(piece)

    def names(self, layer: int | None = None, expert: int | None = None) -> list[str]:
        """The source tensors' names: of one stacked layer (and expert), or of all of them in order."""
        layers = range(max(self.layers, 1)) if layer is None else [layer]
        experts = range(max(self.experts, 1)) if expert is None else [expert]
        return [self._name(s, i, e) for i in layers for e in experts for s in range(len(self.sources))]

    def _name(self, slot: int, layer: int, expert: int) -> str:
        return self.sources[slot].format(layer=layer * self.layer_step + self.layer_offset, expert=expert)

    def read(self, read_source, box: Box) -> np.ndarray:
        """The box of the jaxpar parameter, read through read_source(name, source_box) -> array."""
        if not self.sources:
            return np.zeros([stop - start for start, stop in box], np.float32)
        layer_range, rest = (box[0], box[1:]) if self.layers else ((0, 1), box)
        expert_range, rest = (rest[0], rest[1:]) if self.experts else ((0, 1), rest)
        if self.slot_axis is not None:
            slots = range(*rest[self.slot_axis])
            piece_box = rest[:self.slot_axis] + rest[self.slot_axis + 1:]
        else:
            slots, piece_box = [0], rest
        layers = []
        for layer in range(*layer_range):
            experts = []
            for expert in range(*expert_range):
                pieces = [self._read_piece(read_source, self._name(s, layer, expert), piece_box) for s in slots]
                experts.append(np.stack(pieces, self.slot_axis) if self.slot_axis is not None else pieces[0])
            layers.append(np.stack(experts) if self.experts else experts[0])
        return np.stack(layers) if self.layers else layers[0]

    def _read_piece(self, read_source, name: str, box: Box) -> np.ndarray:
        """A box of one slot of one layer: the source's bounding box, reshaped, trimmed, transposed."""
        want = list(box)
        padded_to = None
        if self.pad is not None:  # rows past the checkpoint's vocabulary are zeros
            axis, stored, _ = self.pad
            start, stop = want[axis]
            padded_to = stop - start
            want[axis] = (min(start, stored), min(stop, stored))
        split_box = [None] * len(self.split)
        for j, d in enumerate(self.perm):
            split_box[d] = want[j]
        source_box, inner = [], []
        for first, factors in _groups(self.source_shape, self.split):
            # a source dimension holding several split ones (heads x head width): read whole inner rows
            stride = math.prod(self.split[first + 1:first + factors])
            outer = split_box[first]
            source_box.append((outer[0] * stride, outer[1] * stride))
            inner.append((outer[1] - outer[0],) + self.split[first + 1:first + factors])
        data = read_source(name, tuple(source_box)).reshape([n for group in inner for n in group])
        trim = tuple(slice(None) if d == first else slice(*split_box[d])
                     for first, factors in _groups(self.source_shape, self.split)
                     for d in range(first, first + factors))
        data = data[trim].transpose(self.perm)
        if padded_to is not None and data.shape[self.pad[0]] < padded_to:
            widths = [(0, 0)] * data.ndim
            widths[self.pad[0]] = (0, padded_to - data.shape[self.pad[0]])
            data = np.pad(data, widths)
        return data

    def to_sources(self, value: np.ndarray, layer: int = 0, expert: int = 0) -> dict[str, np.ndarray]:
        """One stacked layer of the parameter (one expert of it, for an expert map; the whole of an
        unstacked one) as the checkpoint's tensors, padding dropped, by name."""
        out = {}
        for s in range(len(self.sources)):
            piece = np.take(value, s, axis=self.slot_axis) if self.slot_axis is not None else value
            if self.pad is not None:
                piece = np.take(piece, np.arange(self.pad[1]), axis=self.pad[0])
            out[self._name(s, layer, expert)] = piece.transpose(np.argsort(self.perm)).reshape(self.source_shape)
        return out


def _groups(source_shape: tuple[int, ...], split: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first split dimension, how many) for each source dimension: the split dimensions whose product
    it is."""
    groups, d = [], 0
    for size in source_shape:
        first, product = d, 1
        while d == first or product < size:
            product *= split[d]
            d += 1
        if product != size:
            raise ValueError(f"split {split} does not refine {source_shape}")
        groups.append((first, d - first))
    return groups


# A mixture of experts' tensors in each family: the block's name, then the experts' gate, up and down
# projections (one tensor per expert; transformers 5 fuses them in memory and writes these names back).
MOE_TENSORS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
               "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def moe_family(m: ModelConfig) -> str:
    """Which family's tensor names an MoE model reads and writes: Qwen3-MoE's (query/key norms) or Mixtral's."""
    return "qwen3_moe" if m.qk_norm else "mixtral"


def tensor_maps(m: ModelConfig) -> list[TensorMap]:
    """Every parameter of a jaxpar Transformer of shape `m`, as Llama/Mistral/Qwen (dense) or
    Mixtral/Qwen3-MoE tensors."""
    D, V, padded = m.d_model, m.vocab_size, m.padded_vocab
    maps = [TensorMap(("embedding",), ("model.embed_tokens.weight",), (V, D), (V, D), (0, 1), pad=(0, V, padded)),
            TensorMap(("final_norm", "scale"), ("model.norm.weight",), (D,), (D,), (0,))]
    if not m.tie_embeddings:
        maps.append(TensorMap(("head",), ("lm_head.weight",), (V, D), (V, D), (1, 0), pad=(1, V, padded)))
    first = m.moe.first_dense if m.moe.experts else 0
    if first:  # DeepSeek-V3's dense first layers, a stack of their own
        maps += _block_maps(m, ("dense_blocks",), functools.partial(TensorMap, layers=first), moe=False)
    if not m.has_layer_units:
        return maps + _block_maps(m, ("blocks",), functools.partial(TensorMap, layers=m.n_layers), moe=False)
    # The scanned unit of several blocks: every moe.every-th one's MLP the experts (jaxpar.model.transformer)
    every = m.unit_blocks
    for j in range(every):
        stacked = functools.partial(TensorMap, layers=m.units, layer_step=every, layer_offset=first + j)
        maps += _block_maps(m, ("blocks", "blocks", str(j)), stacked, moe=m.block_is_moe(j))
    return maps


def _block_maps(m: ModelConfig, at: tuple[str, ...], stacked, moe: bool) -> list[TensorMap]:
    """One stacked block's parameters (under the path `at`); stacked(path, ...) makes a TensorMap of it."""
    D, H, G, K, F = m.d_model, m.n_heads, m.kv_heads, m.head_size, m.d_ff
    layer, attn = "model.layers.{layer}.", "model.layers.{layer}.self_attn."
    maps = [stacked((*at, "attn_norm", "scale"), (layer + "input_layernorm.weight",), (D,), (D,), (0,)),
            stacked((*at, "mlp_norm", "scale"), (layer + "post_attention_layernorm.weight",), (D,), (D,), (0,)),
            stacked((*at, "attn", "wo"), (attn + "o_proj.weight",), (D, H * K), (D, H, K), (1, 2, 0))]
    if moe:
        maps += _expert_maps(m, at, stacked)
    else:
        maps += [stacked((*at, "mlp", "w_gate_up"), (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
                         (F, D), (F, D), (1, 0), slot_axis=1),
                 stacked((*at, "mlp", "w_down"), (layer + "mlp.down_proj.weight",), (D, F), (D, F), (1, 0))]
    qkv = [attn + f"{p}_proj" for p in "qkv"]
    if G == H:
        maps.append(stacked((*at, "attn", "w_qkv"), tuple(n + ".weight" for n in qkv), (H * K, D), (H, K, D),
                            (2, 0, 1), slot_axis=1))
        if m.qkv_bias:
            maps.append(stacked((*at, "attn", "b_qkv"), tuple(n + ".bias" for n in qkv), (H * K,), (H, K),
                                (0, 1), slot_axis=0))
    else:
        maps += [stacked((*at, "attn", "w_q"), (qkv[0] + ".weight",), (H * K, D), (H, K, D), (2, 0, 1)),
                 stacked((*at, "attn", "w_kv"), tuple(n + ".weight" for n in qkv[1:]), (G * K, D), (G, K, D),
                         (2, 0, 1), slot_axis=1)]
        if m.qkv_bias:
            maps += [stacked((*at, "attn", "b_q"), (qkv[0] + ".bias",), (H * K,), (H, K), (0, 1)),
                     stacked((*at, "attn", "b_kv"), tuple(n + ".bias" for n in qkv[1:]), (G * K,), (G, K),
                             (0, 1), slot_axis=0)]
    if m.qk_norm:
        maps += [stacked((*at, "attn", f"{p}_norm", "scale"), (attn + f"{p}_norm.weight",), (K,), (K,), (0,))
                 for p in "qk"]
    return maps


def _expert_maps(m: ModelConfig, at: tuple[str, ...], stacked) -> list[TensorMap]:
    """The router and the experts of an MoE block: the router's (E, D) `gate`, each expert's gate and up
    projections (F, D) into jaxpar's (E, D, 2, F) and its down projection (D, F) into (E, F, D)."""
    D, E, F = m.d_model, m.moe.experts, m.expert_d_ff
    block, gate, up, down = MOE_TENSORS[moe_family(m)]
    moe, expert = f"model.layers.{{layer}}.{block}.", f"model.layers.{{layer}}.{block}.experts.{{expert}}."
    maps = [stacked((*at, "mlp", "w_router"), (moe + "gate.weight",), (E, D), (E, D), (1, 0)),
            stacked((*at, "mlp", "w_gate_up"), (expert + gate + ".weight", expert + up + ".weight"), (F, D), (F, D),
                    (1, 0), slot_axis=1, experts=E),
            stacked((*at, "mlp", "w_down"), (expert + down + ".weight",), (D, F), (D, F), (1, 0), experts=E)]
    if m.moe.chooses_top_k:  # noisy top-k's noise weight: none in the checkpoint, zeros (the noise is off)
        maps.append(stacked((*at, "mlp", "w_noise"), (), (D, E), (D, E), (0, 1)))
    return maps
