"""Rows of documents (`data.packing`), drawn deterministically from (seed, step) like every batch.

`concat`: windows at random offsets of the concatenated documents, each token labelled with its
document (ids from 0 within the row) and its position in it; a window's first document may have
begun before the window, and starts at position 0 there.
`pack`: whole documents placed into rows before training: documents longer than a row are cut into
row-sized pieces, the pieces are shuffled (seeded), and each goes to the first of the open rows
with room for it (first-fit over a buffer of `PACK_BUFFER` rows, so memory stays bounded). A row's
free end is padding: its own segment, masked out of the loss. Step n draws its rows by index.
Preference pairs (jaxpar.data.preference) are packed only so, each pair one unit: its two documents
whole and consecutive in one row, chosen first; pairs, not documents, are shuffled.
"""

from __future__ import annotations

import numpy as np

from jaxpar.data.documents import Documents, load_documents, split_documents
from jaxpar.data.loader import BatchSampler
from jaxpar.data.packed_rows import PackedRows
from jaxpar.data.preference import check_pair_packing, pair_units

PACK_BUFFER = 64  # open rows a piece may go to


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


def pack_plan(lengths: np.ndarray, width: int, seed: int, pairs: bool = False) -> list[list[tuple[int, int, int]]]:
    """Rows of pieces (document, offset in it, length): documents cut into pieces of at most `width`
    tokens (preference pairs: each pair's two documents whole, one unit; see pair_units), the units
    shuffled and placed first-fit into the open rows (at most PACK_BUFFER; the fullest is closed when
    another must open)."""
    units = pair_units(lengths, width) if pairs else [
        [(d, o, min(width, int(n) - o))] for d, n in enumerate(lengths) for o in range(0, int(n), width)]
    order = np.random.default_rng(seed).permutation(len(units))
    open_rows: list[list] = []  # [free room, pieces]
    closed: list[list] = []
    for i in order:
        unit, size = units[i], sum(piece[2] for piece in units[i])
        for row in open_rows:
            if row[0] >= size:
                row[0] -= size
                row[1].extend(unit)
                break
        else:
            if len(open_rows) == PACK_BUFFER:
                fullest = min(range(len(open_rows)), key=lambda r: open_rows[r][0])
                closed.append(open_rows.pop(fullest)[1])
            open_rows.append([width - size, list(unit)])
    return closed + [row[1] for row in open_rows]


class PackSampler:
    """Rows of whole documents (pack_plan), step n's rows drawn from (seed, n); padding ends a row.
    pairs: the rows hold whole preference pairs (docs.pairs), chosen at even document ids."""

    def __init__(self, docs: Documents, seq_len: int, batch_size: int, seed: int, pad_id: int = 0):
        self.docs, self.seq_len, self.batch_size, self.seed, self.pad_id = docs, seq_len, batch_size, seed, pad_id
        self.pairs = docs.pairs
        self.rows = pack_plan(np.diff(np.concatenate([[0], docs.ends])), seq_len + 1, seed, docs.pairs)
        self._starts = docs.starts

    def starts(self, step: int) -> np.ndarray:
        """The indices of step `step`'s rows in the plan."""
        return self.draw(np.random.default_rng((self.seed, step)), self.batch_size)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` rows of the plan drawn with `rng`."""
        return rng.integers(0, len(self.rows), size=count)

    def validation_starts(self, count: int) -> dict[str, np.ndarray]:
        return {"": self.fixed_starts(count)}

    def fixed_starts(self, count: int) -> np.ndarray:
        """(count, batch_size) rows spread evenly over the plan (for validation)."""
        picks = np.linspace(0, len(self.rows) - 1, count * self.batch_size).astype(np.int64)
        return picks.reshape(count, self.batch_size)

    def windows(self, row_ids: np.ndarray) -> PackedRows:
        width, rows = self.seq_len + 1, []
        for r in np.asarray(row_ids, np.int64):
            tokens, segments, positions, masks = [], [], [], []
            for segment, (doc, offset, length) in enumerate(self.rows[int(r)]):
                begin = int(self._starts[doc]) + offset
                tokens.append(np.asarray(self.docs.tokens[begin:begin + length]))
                segments.append(np.full(length, segment, np.int32))
                positions.append(np.arange(length, dtype=np.int32))
                masks.append(np.ones(length, np.int32) if self.docs.mask is None
                             else np.asarray(self.docs.mask[begin:begin + length], np.int32))
            pad = width - sum(len(t) for t in tokens)
            if pad:  # its own segment, out of the loss
                tokens.append(np.full(pad, self.pad_id, tokens[0].dtype))
                segments.append(np.full(pad, len(self.rows[int(r)]), np.int32))
                positions.append(np.arange(pad, dtype=np.int32))
                masks.append(np.zeros(pad, np.int32))
            rows.append(tuple(np.concatenate(part) for part in (tokens, segments, positions, masks)))
        return _stacked(rows)

    def efficiency(self, row_ids: np.ndarray) -> float:
        """The share of these rows' token slots that hold document tokens rather than padding."""
        used = sum(length for r in np.asarray(row_ids, np.int64) for _, _, length in self.rows[int(r)])
        return used / (len(row_ids) * (self.seq_len + 1))


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
    return tuple(PackSampler(p, model.seq_len, train.batch_size, train.seed) for p in parts)
