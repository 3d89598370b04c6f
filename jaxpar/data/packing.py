"""Rows of documents (`data.packing`), drawn deterministically from (seed, step) like every batch.

`concat`: windows at random offsets of the concatenated documents, each token labelled with its
document (ids from 0 within the row) and its position in it; a window's first document may have
begun before the window, and starts at position 0 there.
`pack`: whole documents placed into rows before training: documents longer than a row are cut into
row-sized pieces, the pieces are shuffled (seeded), and each goes to the first of the open rows
with room for it (first-fit over a buffer of rows; jaxpar.data.pack_plan plans it, and a token
folder keeps the plan). A row's free end is padding: its own segment, masked out of the loss. Step
n draws its rows by index.
Preference pairs (jaxpar.data.preference) are packed only so, each pair one unit: its two documents
whole and consecutive in one row, chosen first; pairs, not documents, are shuffled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.data.documents import Documents, load_documents, split_documents
from jaxpar.data.loader import BatchSampler
from jaxpar.data.pack_plan import cached_pack_plan
from jaxpar.data.packed_rows import PackedRows
from jaxpar.data.preference import check_pair_packing


def _labelled(tokens_T: np.ndarray, doc_T: np.ndarray, starts: np.ndarray, begin: int, mask_T) -> tuple:
    """(segments, positions, mask) of a window of tokens from offset `begin`, given each token's document."""
    segments_T = doc_T - doc_T[0]
    positions_T = begin + np.arange(len(tokens_T)) - np.maximum(starts[doc_T], begin)
    mask_T = np.ones(len(tokens_T), np.int32) if mask_T is None else np.asarray(mask_T, np.int32)
    return segments_T.astype(np.int32), positions_T.astype(np.int32), mask_T


class ConcatSampler(BatchSampler):
    """BatchSampler's windows of seq_len+1 tokens (the same draws from (seed, step)), each token marked
    with its document."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, seed: int):
        super().__init__(docs.tokens, seq_len, batch_size, seed)
        self.docs, self._starts = docs, docs.starts

    def efficiency(self, starts: np.ndarray) -> float:
        """Windows of the concatenation hold no padding."""
        return 1.0

    def windows(self, starts: np.ndarray) -> PackedRows:
        width, rows = self.seq_len + 1, []
        for begin in np.asarray(starts, np.int64):
            tokens_T = np.asarray(self._read(begin))
            doc_T = np.searchsorted(self.docs.ends, begin + np.arange(width), side="right")
            mask_T = None if self.docs.mask is None else self.docs.mask[begin:begin + width]
            rows.append((tokens_T, *_labelled(tokens_T, doc_T, self._starts, int(begin), mask_T)))
        return _stacked(rows)


class PackSampler:
    """Rows of whole documents (jaxpar.data.pack_plan), step n's rows drawn from (seed, n); padding ends a
    row. pairs: the rows hold whole preference pairs (docs.pairs), chosen at even document ids.
    cache: the token folder the documents come from, where the plan is kept (None: planned each time)."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, seed: int, pad_id: int = 0,
                 cache: Path | None = None):
        self.docs, self.seq_len, self.batch_size, self.seed, self.pad_id = docs, seq_len, batch_size, seed, pad_id
        self.pairs = docs.pairs
        self.plan = cached_pack_plan(np.diff(docs.ends, prepend=0), seq_len + 1, seed, docs.pairs, cache)
        self._starts = docs.starts

    def starts(self, step: int) -> np.ndarray:
        """The indices of step `step`'s rows in the plan."""
        return self.draw(np.random.default_rng((self.seed, step)), self.batch_size)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` rows of the plan drawn with `rng`."""
        return rng.integers(0, len(self.plan), size=count)

    def validation_starts(self, count: int) -> dict[str, np.ndarray]:
        return {"": self.fixed_starts(count)}

    def fixed_starts(self, count: int) -> np.ndarray:
        """(count, batch_size) rows spread evenly over the plan (for validation)."""
        picks = np.linspace(0, len(self.plan) - 1, count * self.batch_size).astype(np.int64)
        return picks.reshape(count, self.batch_size)

    def windows(self, row_ids: np.ndarray) -> PackedRows:
        """The rows `row_ids` of the plan: each piece a segment from position 0, then the row's padding,
        its own last segment, out of the loss."""
        width, rows = self.seq_len + 1, np.asarray(row_ids, np.int64)
        pieces, counts = self.plan.pieces(rows)
        lengths = self.plan.piece_length[pieces].astype(np.int64)
        span_length, span_segment, is_piece = _row_spans(lengths, counts, width)
        span_start = np.cumsum(span_length) - span_length
        tokens = np.full(len(rows) * width, self.pad_id, np.int32)
        mask = np.repeat(is_piece, span_length).astype(np.int32)
        begins = self._starts[self.plan.piece_doc[pieces]] + self.plan.piece_offset[pieces]
        for at, begin, length in zip(span_start[is_piece].tolist(), begins.tolist(), lengths.tolist()):
            tokens[at:at + length] = np.asarray(self.docs.tokens[begin:begin + length])
            if self.docs.mask is not None:
                mask[at:at + length] = np.asarray(self.docs.mask[begin:begin + length])
        positions = np.arange(len(tokens)) - np.repeat(span_start, span_length)
        segments = np.repeat(span_segment, span_length)
        return PackedRows(*(a.astype(np.int32).reshape(len(rows), width) for a in (tokens, segments, positions, mask)))

    def efficiency(self, row_ids: np.ndarray) -> float:
        """The share of these rows' token slots that hold document tokens rather than padding."""
        return self.plan.used(np.asarray(row_ids, np.int64)) / (len(row_ids) * (self.seq_len + 1))


def _row_spans(lengths: np.ndarray, counts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans filling rows of `width` tokens end to end: each row's pieces (`counts` of them, of `lengths`
    tokens), then its padding (of no tokens in a full row). (Each span's length, its segment in its row,
    whether it is a piece.)"""
    row_of_piece = np.repeat(np.arange(len(counts)), counts)
    first_piece = np.cumsum(counts) - counts
    at = np.arange(len(lengths)) + row_of_piece  # a piece's span follows its row's pieces and earlier rows' paddings
    padding_at = first_piece + counts + np.arange(len(counts))
    before = np.concatenate([[0], np.cumsum(lengths)])
    span_length, span_segment = np.empty((2, len(lengths) + len(counts)), np.int64)
    span_length[at], span_segment[at] = lengths, np.arange(len(lengths)) - first_piece[row_of_piece]
    span_length[padding_at] = width - (before[first_piece + counts] - before[first_piece])
    span_segment[padding_at] = counts
    is_piece = np.zeros(len(span_length), bool)
    is_piece[at] = True
    return span_length, span_segment, is_piece


def _stacked(rows: list[tuple]) -> PackedRows:
    tokens, segments, positions, masks = (np.stack(part) for part in zip(*rows))
    return PackedRows(tokens.astype(np.int32), segments, positions, masks)


def packed_samplers(data, model, train, source: str | None = None) -> tuple:
    """(train, validation) samplers of data.packing's rows over the documents of `source` (default
    data.source). Preference pairs need data.packing=pack."""
    source = data.source if source is None else source
    docs = load_documents(source, model.vocab_size)
    if docs.pairs:
        check_pair_packing(source, data.packing)
    parts = split_documents(docs, data.val_fraction, model.seq_len)
    if data.packing == "concat":
        return tuple(ConcatSampler(p, model.seq_len, train.batch_size, train.seed) for p in parts)
    cache = None if source == "builtin" else Path(source)  # a token folder keeps its plans
    return tuple(PackSampler(p, model.seq_len, train.batch_size, train.seed, cache=cache) for p in parts)
