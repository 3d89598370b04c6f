"""One work unit of `jaxpar tokenize` encoded and written: its token (and loss-mask) shard files, its
document ends, and last a record that it is complete, so a rerun skips it.

Documents are encoded in batches with the tokenizer's own `encode_batch_fast` (no offsets: only ids are
kept), so tokenizing runs at the tokenizer's speed rather than one call per document. A unit's shards
are named by the unit's index (tokens-UUUUUU-CCC.bin), so every worker, --shard task or rerun writes
the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.data.folders import write_atomically, write_durably
from jaxpar.tokenize.chat import ChatFormat
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.tokenize.work_units import WorkUnit, unit_digest, unit_documents

BATCH_BYTES = 1 << 20  # text encoded per call
BATCH_DOCUMENTS = 4096
UNITS = "units"  # the folder of each unit's ends and completion record, while a run is under way


def unit_record(folder: Path, index: int) -> Path:
    return folder / UNITS / f"{index:06d}.json"


def unit_ends(folder: Path, index: int) -> Path:
    return folder / UNITS / f"{index:06d}-ends.bin"


class UnitEncoder:
    """Encodes units with one tokenizer: spec says what a document is, settings (tokenizer_config.json)
    how chats render, end_ids ends every document, dtype and shard_tokens how shards are written."""

    def __init__(self, tokenizer, spec: DocumentSpec, settings: dict, end_ids: np.ndarray, dtype: str,
                 shard_tokens: int):
        self.tokenizer, self.spec, self.settings, self.end_ids = tokenizer, spec, settings, end_ids
        self.chat = ChatFormat(settings) if spec.chat else None
        self.dtype, self.shard_tokens = dtype, shard_tokens

    def __reduce__(self):  # to a worker process: rebuilt there (a compiled chat template does not pickle)
        return UnitEncoder, (self.tokenizer, self.spec, self.settings, self.end_ids, self.dtype, self.shard_tokens)

    def write(self, unit: WorkUnit, folder: Path, progress=None) -> dict:
        """Encode `unit` into `folder`; returns its record ({shards, tokens, sha256}). progress(bytes, tokens)
        is told as batches finish."""
        writer = _ShardWriter(folder, unit.index, self.dtype, self.shard_tokens, self.spec.masked)
        ends: list[int] = []
        for batch, size in _batches(unit_documents(unit, self.spec)):
            before = writer.total
            for (ids, mask), (_, ends_document) in zip(self._encode(batch), batch):
                writer.add(ids, mask)
                if ends_document and (not ends or ends[-1] < writer.total):  # an empty document is none
                    ends.append(writer.total)
            if progress is not None:
                progress(size, writer.total - before)
        writer.flush(final=True)
        write_durably(unit_ends(folder, unit.index), np.asarray(ends, np.int64))  # on disk before the record
        result = {"shards": writer.shards, "tokens": writer.total, "sha256": unit_digest(unit)}
        write_atomically(unit_record(folder, unit.index), json.dumps(result))
        return result

    def _encode(self, batch: list[tuple[object, bool]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each document's (piece's) token ids, and for fine-tuning sets its loss mask (1: counted)."""
        pieces = [self._pieces(content) for content, _ in batch]
        texts = [text for document in pieces for text, _ in document]
        encoded = iter(self.tokenizer.encode_batch_fast(texts, add_special_tokens=False) if texts else [])
        out = []
        for document, (_, ends_document) in zip(pieces, batch):
            ids = [np.asarray(next(encoded).ids, np.int64) for _ in document]
            end = self.end_ids if ends_document or self.spec.masked else self.end_ids[:0]
            if not self.spec.masked:
                out.append((np.concatenate([*ids, end]), None))
                continue
            masks = [np.full(len(i), int(counted), np.uint8) for i, (_, counted) in zip(ids, document)]
            out.append((np.concatenate([*ids, end]), np.concatenate([*masks, np.ones(len(end), np.uint8)])))
        return out

    def _pieces(self, content) -> list[tuple[str, bool]]:
        """A document's texts, each with whether the loss counts it."""
        if not self.spec.masked:
            return [(content, True)]
        pieces = self.chat.pieces(content) if self.spec.chat else [(content[0], False), (content[1], True)]
        if self.spec.preference:  # the response is the conversation's last message, the one the pair differs in
            last = max(i for i, (_, counted) in enumerate(pieces) if counted)
            pieces = [(text, i == last) for i, (text, _) in enumerate(pieces)]
        return pieces


def _size(content) -> int:
    """About how many bytes of text a document is (for the progress bar)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, tuple):
        return sum(len(text) for text in content)
    return sum(len(message["content"]) for message in content)


def _batches(documents):
    """(batch, its bytes of text): documents in batches of about BATCH_BYTES of text (at most BATCH_DOCUMENTS)."""
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += _size(document[0])
        if size >= BATCH_BYTES or len(batch) == BATCH_DOCUMENTS:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


class _ShardWriter:
    """A unit's token (and loss-mask) shards of at most shard_tokens each, written as its documents come."""

    def __init__(self, folder: Path, unit: int, dtype: str, shard_tokens: int, with_mask: bool):
        self.folder, self.unit, self.dtype, self.shard_tokens = folder, unit, dtype, shard_tokens
        self.with_mask = with_mask
        self.shards: list[dict] = []
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.pending = self.total = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.ids.append(ids)
        if self.with_mask:
            self.masks.append(mask)
        self.total += len(ids)
        self.pending += len(ids)
        if self.pending >= self.shard_tokens:
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        mask = np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)
        while len(ids) >= self.shard_tokens or (final and len(ids)):
            name = f"{self.unit:06d}-{len(self.shards):03d}.bin"
            entry = {"file": f"tokens-{name}", "tokens": int(min(len(ids), self.shard_tokens))}
            write_durably(self.folder / entry["file"], ids[:self.shard_tokens].astype(self.dtype))
            if self.with_mask:
                entry["mask"] = f"mask-{name}"
                write_durably(self.folder / entry["mask"], mask[:self.shard_tokens].astype(np.uint8))
                mask = mask[self.shard_tokens:]
            self.shards.append(entry)
            ids = ids[self.shard_tokens:]
        self.ids = [ids] if len(ids) else []
        self.masks = [mask] if len(mask) else []
        self.pending = len(ids)
