"""`jaxpar tokenize`: train a byte-level BPE tokenizer on text files (the `tokenizers` library,
offline) or apply an existing one (a tokenizer.json, or a folder holding one: a Hugging Face
checkpoint or another tokenized folder), and write a tokenized folder (jaxpar.data.token_folder).

The folder is written under a temporary name and renamed when complete, so an interrupted run
leaves nothing half-written. Byte-level BPE is lossless: decoding the ids gives the text back.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxpar.data.token_folder import COMPANION_FILES, FORMAT, META, TOKENIZER, token_dtype, tokenizer_json
from jaxpar.errors import DataError
from jaxpar.folders import is_free, new_folder

CHUNK_BYTES = 1 << 22  # text encoded per batch
SHARD_TOKENS = 1 << 24  # tokens per shard file (32 MiB of uint16)
MIN_VOCAB = 257  # the 256 byte tokens and at least one merge


def check_tokenize_args(inputs: list[str], vocab_size: int | None, out: str, tokenizer: str | None) -> None:
    """Every user mistake in `jaxpar tokenize`'s arguments, as one DataError sentence."""
    for name in inputs:
        if not Path(name).is_file():
            raise DataError(f"--input '{name}' is not a file.")
    if tokenizer is None:
        if vocab_size is None or not MIN_VOCAB <= vocab_size <= 2 ** 32:
            raise DataError(f"--vocab-size must be between {MIN_VOCAB} (the 256 bytes and one merge) and 2**32, "
                            f"got {vocab_size}; or give --tokenizer FILE to apply an existing tokenizer.")
    else:
        tokenizer_json(tokenizer)
    if not is_free(Path(out)):
        raise DataError(f"--out '{out}' exists and is not an empty folder; choose a new one.")


def _train(inputs: list[str], vocab_size: int, progress: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress, special_tokens=[])
    tokenizer.train(inputs, trainer)
    return tokenizer


def _chunks(path: Path, size: int):
    """Text of `path` in pieces of about `size` bytes, cut at line ends."""
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        while True:
            text = f.read(size)
            if not text:
                return
            text += f.readline()  # finish the line, so no word is cut
            yield text


def tokenize(inputs: list[str], out: str, vocab_size: int | None = None, tokenizer_file: str | None = None,
             progress: bool = True, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize `inputs` into the folder `out`; returns its meta.json."""
    from tokenizers import Tokenizer

    check_tokenize_args(inputs, vocab_size, out, tokenizer_file)
    tokenizer_file = str(tokenizer_json(tokenizer_file)) if tokenizer_file else None
    tokenizer = Tokenizer.from_file(tokenizer_file) if tokenizer_file else _train(inputs, vocab_size, progress)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    with new_folder(Path(out)) as work:
        tokenizer.save(str(work / TOKENIZER))
        for companion in COMPANION_FILES:  # a checkpoint's tokenizer settings travel with it, for export
            if tokenizer_file and (Path(tokenizer_file).parent / companion).is_file():
                shutil.copyfile(Path(tokenizer_file).parent / companion, work / companion)
        digest, shards, buffer, total = hashlib.sha256(), [], [], 0

        def flush(final: bool) -> None:
            nonlocal buffer
            ids = np.concatenate(buffer) if buffer else np.zeros(0, dtype)
            while len(ids) >= shard_tokens or (final and len(ids)):
                name = f"tokens-{len(shards):05d}.bin"
                ids[:shard_tokens].astype(dtype).tofile(work / name)
                shards.append({"file": name, "tokens": int(min(len(ids), shard_tokens))})
                ids = ids[shard_tokens:]
            buffer = [ids] if len(ids) else []

        size = sum(Path(p).stat().st_size for p in inputs)
        with tqdm(total=size, unit="B", unit_scale=True, desc="tokenize", disable=not progress,
                  file=sys.stderr) as bar:
            for name in inputs:
                for text in _chunks(Path(name), CHUNK_BYTES):
                    data = text.encode("utf-8")
                    digest.update(data)
                    lines = text.splitlines(keepends=True)
                    # no special tokens: a checkpoint's tokenizer would open every line with its BOS
                    encoded = tokenizer.encode_batch(lines, add_special_tokens=False)
                    ids = np.fromiter((i for e in encoded for i in e.ids), np.int64)
                    buffer.append(ids)
                    total += len(ids)
                    flush(final=False)
                    bar.update(len(data))
        flush(final=True)
        meta = {"format": FORMAT, "vocab_size": vocab, "dtype": dtype, "tokens": total, "shards": shards,
                "inputs": [str(p) for p in inputs], "inputs_sha256": digest.hexdigest(), "tokenizer": TOKENIZER}
        (work / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
