"""`jaxpar tokenize`: train a byte-level BPE tokenizer on the inputs' documents (the `tokenizers`
library, offline) or apply an existing one (a tokenizer.json, or a folder holding one: a Hugging
Face checkpoint or another tokenized folder), and write a tokenized folder (jaxpar.data.token_folder).

Documents keep their boundaries (jaxpar.data.document_readers says what a document is for each
input): each ends with the end-of-document token (a trained tokenizer reserves `EOD`; an applied one
gives its own end-of-sequence token, when it has one), and documents.bin lists where each ends, for
`data.packing`. Fine-tuning pairs (--sft) and chats (--chat) also write a loss mask per token: 0 on
the prompt (the other messages), 1 on the response (the assistant's messages) and the end token.
Preference pairs (--preference, with --chat for conversations) write each record as two such
documents, prompt + chosen response then prompt + rejected response (of a conversation, only its
last message, the assistant's response, is counted), and meta.json says `"preference": true`.

The folder is written under a temporary name and renamed when complete, so an interrupted run or a
malformed input leaves nothing half-written. Byte-level BPE is lossless: decoding gives the text back.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar.data.chat import ChatFormat
from jaxpar.data.document_readers import DocumentSpec, check_inputs, documents
from jaxpar.data.folders import is_free, new_folder
from jaxpar.data.token_folder import (
    COMPANION_FILES,
    FORMAT,
    META,
    TOKENIZER,
    special_token,
    token_dtype,
    tokenizer_json,
    tokenizer_settings,
)
from jaxpar.errors import DataError

SHARD_TOKENS = 1 << 24  # tokens per shard file (32 MiB of uint16)
MIN_VOCAB = 258  # the 256 byte tokens, the end-of-document token and at least one merge
EOD = "<|endoftext|>"
EOS_NAMES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")  # an applied tokenizer's own, if any
DOCUMENTS = "documents.bin"
PLAIN_TEXT = DocumentSpec()  # .txt files, a document each


def check_tokenize_args(inputs: list[str], vocab_size: int | None, out: str, tokenizer: str | None,
                        spec: DocumentSpec = PLAIN_TEXT) -> None:
    """Every user mistake in `jaxpar tokenize`'s arguments, as one DataError sentence."""
    check_inputs(inputs, spec)
    if tokenizer is None:
        if vocab_size is None or not MIN_VOCAB <= vocab_size <= 2 ** 32:
            raise DataError(f"--vocab-size must be between {MIN_VOCAB} (the 256 bytes, the end-of-document token "
                            f"and one merge) and 2**32, got {vocab_size}; or give --tokenizer FILE to apply an "
                            f"existing tokenizer.")
    else:
        tokenizer_json(tokenizer)
    if not is_free(Path(out)):
        raise DataError(f"--out '{out}' exists and is not an empty folder; choose a new one.")


def _train(inputs: list[str], vocab_size: int, progress: bool, spec: DocumentSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress, special_tokens=[EOD])

    def texts():
        for name in inputs:
            for content, _ in documents(Path(name), spec):
                if isinstance(content, list):  # a chat: its messages
                    yield from (m["content"] for m in content)
                else:
                    yield from (content if isinstance(content, tuple) else (content,))

    tokenizer.train_from_iterator(texts(), trainer)
    return tokenizer


def end_of_document(tokenizer, settings: dict) -> int | None:
    """The id that ends every document: a trained tokenizer's EOD, else the applied tokenizer's
    end-of-sequence token (its settings' eos_token, else a usual name), else None."""
    eos = special_token(settings, "eos_token")
    for name in ([eos] if eos else []) + list(EOS_NAMES):
        if tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    return None


def _encode(tokenizer, text: str) -> np.ndarray:
    # line by line (in parallel); no special tokens: a checkpoint's tokenizer would open every line with its BOS
    encoded = tokenizer.encode_batch(text.splitlines(keepends=True), add_special_tokens=False)
    return np.fromiter((i for e in encoded for i in e.ids), np.int64)


def _document(tokenizer, content, spec: DocumentSpec, chat: ChatFormat | None, end_ids: np.ndarray,
              ends_document: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A document's (piece's) token ids, and for fine-tuning sets its loss mask (1: counted)."""
    if not spec.masked:
        return np.concatenate([_encode(tokenizer, content), end_ids if ends_document else end_ids[:0]]), None
    pieces = chat.pieces(content) if spec.chat else [(content[0], False), (content[1], True)]
    if spec.preference:  # the response is the conversation's last message, the one the pair differs in
        last = max(i for i, (_, counted) in enumerate(pieces) if counted)
        pieces = [(text, i == last) for i, (text, _) in enumerate(pieces)]
    ids = [_encode(tokenizer, text) for text, _ in pieces] + [end_ids]
    masks = [np.full(len(i), int(counted), np.uint8) for i, (_, counted) in zip(ids, pieces)]
    return np.concatenate(ids), np.concatenate(masks + [np.ones(len(end_ids), np.uint8)])


class _ShardWriter:
    """Token (and loss-mask) shards of SHARD_TOKENS each, written as the documents come."""

    def __init__(self, work: Path, dtype: str, shard_tokens: int, with_mask: bool):
        self.work, self.dtype, self.shard_tokens, self.with_mask = work, dtype, shard_tokens, with_mask
        self.shards: list[dict] = []
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.total = 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.ids.append(ids)
        if self.with_mask:
            self.masks.append(mask)
        self.total += len(ids)
        self.flush(final=False)

    def flush(self, final: bool) -> None:
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        mask = np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)
        while len(ids) >= self.shard_tokens or (final and len(ids)):
            entry = {"file": f"tokens-{len(self.shards):05d}.bin", "tokens": int(min(len(ids), self.shard_tokens))}
            ids[:self.shard_tokens].astype(self.dtype).tofile(self.work / entry["file"])
            if self.with_mask:
                entry["mask"] = f"mask-{len(self.shards):05d}.bin"
                mask[:self.shard_tokens].astype(np.uint8).tofile(self.work / entry["mask"])
                mask = mask[self.shard_tokens:]
            self.shards.append(entry)
            ids = ids[self.shard_tokens:]
        self.ids = [ids] if len(ids) else []
        self.masks = [mask] if len(mask) else []


def tokenize(inputs: list[str], out: str, vocab_size: int | None = None, tokenizer_file: str | None = None,
             progress: bool = True, shard_tokens: int = SHARD_TOKENS, spec: DocumentSpec = PLAIN_TEXT) -> dict:
    """Tokenize the documents of `inputs` into the folder `out`; returns its meta.json."""
    from tokenizers import Tokenizer

    check_tokenize_args(inputs, vocab_size, out, tokenizer_file, spec)
    tokenizer_file = str(tokenizer_json(tokenizer_file)) if tokenizer_file else None
    tokenizer = Tokenizer.from_file(tokenizer_file) if tokenizer_file else _train(inputs, vocab_size, progress, spec)
    settings = tokenizer_settings(Path(tokenizer_file).parent if tokenizer_file else None)
    eod = end_of_document(tokenizer, settings)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    with new_folder(Path(out)) as work:
        tokenizer.save(str(work / TOKENIZER))
        for companion in COMPANION_FILES:  # a checkpoint's tokenizer settings travel with it, for export
            if tokenizer_file and (Path(tokenizer_file).parent / companion).is_file():
                shutil.copyfile(Path(tokenizer_file).parent / companion, work / companion)
        writer, ends, digest = _ShardWriter(work, dtype, shard_tokens, spec.masked), [], hashlib.sha256()
        chat = ChatFormat(settings) if spec.chat else None
        end_ids = np.asarray([] if eod is None else [eod], np.int64)
        size = sum(Path(p).stat().st_size for p in inputs)
        with tqdm(total=size, unit="B", unit_scale=True, desc="tokenize", disable=not progress,
                  file=sys.stderr) as bar:
            for name in inputs:
                with open(name, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                for content, ends_document in documents(Path(name), spec):
                    writer.add(*_document(tokenizer, content, spec, chat, end_ids, ends_document))
                    if ends_document and (not ends or ends[-1] < writer.total):  # an empty document is none
                        ends.append(writer.total)
                bar.update(Path(name).stat().st_size)
        writer.flush(final=True)
        if not ends:
            raise DataError(f"the inputs {', '.join(inputs)} hold no text to tokenize.")
        np.asarray(ends, np.int64).tofile(work / DOCUMENTS)
        meta = {"format": FORMAT, "vocab_size": vocab, "dtype": dtype, "tokens": writer.total,
                "shards": writer.shards, "documents": {"file": DOCUMENTS, "count": len(ends)}, "eod_id": eod,
                "loss_mask": spec.masked, "preference": spec.preference, "inputs": [str(p) for p in inputs],
                "inputs_sha256": digest.hexdigest(), "tokenizer": TOKENIZER}
        (work / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
