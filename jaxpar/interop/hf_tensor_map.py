"""One jaxpar parameter as Hugging Face tensors, read both ways (the table of them: jaxpar.interop.hf_names).

A `TensorMap` says it as data: the source tensors (one per slot), how each is reshaped (`split`),
its rows reordered (`reorder`: DeepSeek's interleaved rotary rows) and transposed (`perm`) into one
slot of one layer (and expert), the axis the slots stack on, the vocabulary padding, and which
checkpoint layer each stacked one is. From that, `read` takes any box of the jaxpar parameter (a
device's shard) and reads just the rows and columns of the source tensors inside it, and
`to_sources` turns one layer (and expert) of a parameter back into the tensors a checkpoint stores.

Pure NumPy: the checks before compiling and the export use it without jax.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

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
    layer i x layer_step + layer_offset; reorder (d, order): row j of split dimension d in jaxpar is the
    source's row order[j] (an exact permutation, undone on the way back).
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
    reorder: tuple[int, tuple[int, ...]] | None = None  # (a dimension of split, its rows' order)

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
        if self.reorder is not None:  # the reordered dimension read whole, its wanted rows taken after
            axis, order = self.reorder
            rows = order[slice(*split_box[axis])]
            split_box[axis] = (0, self.split[axis])
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
        data = data[trim]
        if self.reorder is not None:
            data = np.take(data, rows, axis=self.reorder[0])
        data = data.transpose(self.perm)
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
            piece = piece.transpose(np.argsort(self.perm))
            if self.reorder is not None:
                piece = np.take(piece, np.argsort(self.reorder[1]), axis=self.reorder[0])
            out[self._name(s, layer, expert)] = piece.reshape(self.source_shape)
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
