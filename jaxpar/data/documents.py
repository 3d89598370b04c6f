"""A corpus as documents: one token stream, where each document ends (`ends`, cumulative), and for
fine-tuning sets a loss mask per token (1: a response token the loss counts, 0: a prompt token).

Where documents come from: a tokenized folder that `jaxpar tokenize` wrote with its document
offsets (documents.bin), or the built-in corpus, one document per topic of Python's documentation.
The train and validation parts are split between documents (between pairs, for preference pairs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxpar.data.corpus import BYTE_VOCAB, builtin_topics, load_tokens
from jaxpar.data.token_folder import META, is_token_folder, open_mask, read_meta
from jaxpar.errors import DataError


@dataclasses.dataclass(frozen=True)
class Documents:
    """tokens: the stream (memory-mapped for a folder); ends: each document's end offset in it,
    increasing, the last one len(tokens); mask: per token, 1 where the loss may count it (None: all);
    pairs: preference pairs (jaxpar.data.preference), document 2k chosen and 2k + 1 its rejected one."""

    tokens: object
    ends: np.ndarray
    mask: object = None
    pairs: bool = False

    def __len__(self) -> int:
        return len(self.ends)

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    def part(self, first: int, last: int) -> Documents:
        """Documents [first, last) as a corpus of their own (views: nothing is read)."""
        begin, end = (int(self.ends[first - 1]) if first else 0), int(self.ends[last - 1])
        mask = None if self.mask is None else self.mask[begin:end]
        return Documents(self.tokens[begin:end], self.ends[first:last] - begin, mask, self.pairs)


def load_documents(source: str, vocab_size: int) -> Documents:
    """The documents of data.source (a tokenized folder with document offsets, or 'builtin'); raises
    DataError for a source that has none."""
    if source == "builtin":
        if vocab_size < BYTE_VOCAB:
            raise DataError(f"text is tokenized as bytes, so model.vocab_size must be at least {BYTE_VOCAB}, "
                            f"got {vocab_size}.")
        pieces = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in builtin_topics()]
        return Documents(np.concatenate(pieces), np.cumsum([len(p) for p in pieces]).astype(np.int64))
    if not is_token_folder(source):
        raise DataError(f"data.packing needs documents: data.source must be 'builtin' or a folder that `jaxpar "
                        f"tokenize` wrote, not '{source}'.")
    tokens = load_tokens(source, vocab_size)
    meta = read_meta(Path(source))
    docs = meta.get("documents")
    if not isinstance(docs, dict) or not isinstance(docs.get("file"), str) or not isinstance(docs.get("count"), int):
        raise DataError(f"data.source '{source}' was tokenized without document offsets; tokenize it again with "
                        f"this jaxpar to train with data.packing.")
    path = Path(source, docs["file"])
    if not path.is_file() or path.stat().st_size != 8 * docs["count"]:
        raise DataError(f"data.source '{source}': {docs['file']} is missing or does not hold the {docs['count']} "
                        f"document offsets {META} lists.")
    ends = np.fromfile(path, dtype=np.int64)
    if len(ends) == 0 or ends[-1] != len(tokens) or np.any(np.diff(ends) <= 0) or ends[0] <= 0:
        raise DataError(f"data.source '{source}': {docs['file']} does not hold increasing document ends up to the "
                        f"{len(tokens)} tokens.")
    mask = open_mask(source, meta) if meta.get("loss_mask") else None
    pairs = meta.get("preference") is True
    if pairs and (mask is None or len(ends) % 2):
        lacks = "" if mask is not None else " and no loss mask"
        raise DataError(f"data.source '{source}' says it holds preference pairs, but has {len(ends)} documents"
                        f"{lacks}; tokenize it again with `jaxpar tokenize --preference`.")
    return Documents(tokens, ends, mask, pairs)


def split_documents(docs: Documents, val_fraction: float, seq_len: int) -> tuple[Documents, Documents]:
    """Train and validation documents: the validation part is the last documents, at least
    val_fraction of the tokens; each part needs a document (a pair, for preference pairs, which the
    split never cuts) and a full row of tokens."""
    unit = 2 if docs.pairs else 1
    total = int(docs.ends[-1])
    first_val = int(np.searchsorted(docs.ends, total - int(total * val_fraction), side="left"))
    first_val = min(max(first_val - first_val % unit, unit), len(docs) - unit) if len(docs) > unit else unit
    train_tokens = int(docs.ends[first_val - 1])
    if len(docs) < 2 * unit or train_tokens < seq_len + 1 or total - train_tokens < seq_len + 1:
        what = f"{len(docs) // 2} preference pairs" if docs.pairs else f"{len(docs)} documents"
        raise DataError(f"the corpus has {what} and {total} tokens, too few for packed rows of "
                        f"model.seq_len={seq_len} in both the train and validation parts (data.val_fraction="
                        f"{val_fraction}); each part needs a {'pair' if docs.pairs else 'document'} and at least "
                        f"{seq_len + 1} tokens.")
    return docs.part(0, first_val), docs.part(first_val, len(docs))
