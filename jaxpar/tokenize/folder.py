"""`jaxpar tokenize`: train a byte-level BPE tokenizer on the inputs' documents (the `tokenizers`
library, offline) or apply an existing one (a tokenizer.json, or a folder holding one: a Hugging
Face checkpoint or another tokenized folder), and write a tokenized folder (jaxpar.data.token_folder).

Documents keep their boundaries (jaxpar.tokenize.document_readers says what a document is for each
input): each ends with the end-of-document token (a trained tokenizer reserves `EOD`; an applied one
gives its own end-of-sequence token, when it has one), and documents.bin lists where each ends, for
`data.packing`. Fine-tuning pairs (--sft) and chats (--chat) also write a loss mask per token: 0 on
the prompt (the other messages), 1 on the response (the assistant's messages) and the end token.
Preference pairs (--preference, with --chat for conversations) write each record as two such
documents, prompt + chosen response then prompt + rejected response (of a conversation, only its
last message, the assistant's response, is counted), and meta.json says `"preference": true`.

The work is cut into units (jaxpar.tokenize.work_units) that `workers` processes share and `shard` = (i, n)
tasks split (units i, i + n, ...), each writing a part that `jaxpar tokenize --merge` joins; every way
gives the same bytes. The folder is filled under a hidden name beside it (jaxpar.tokenize.resumable)
and renamed when complete, so an interrupted run leaves nothing that training would accept, and a
rerun continues from its finished units. Byte-level BPE is lossless: decoding gives the text back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxpar.data.folders import is_free
from jaxpar.data.token_folder import EOD, end_of_document, token_dtype, tokenizer_json, tokenizer_settings
from jaxpar.errors import DataError
from jaxpar.tokenize.assembly import finish, read_units, shard_meta
from jaxpar.tokenize.document_readers import DocumentSpec, check_inputs
from jaxpar.tokenize.input_files import InputFile, expand_inputs
from jaxpar.tokenize.resumable import PartialFolder, encode_units
from jaxpar.tokenize.unit_encoding import UnitEncoder
from jaxpar.tokenize.work_units import UNIT_BYTES, WorkUnit, plan_units, unit_documents

SHARD_TOKENS = 1 << 24  # tokens per shard file at most (32 MiB of uint16)
MIN_VOCAB = 258  # the 256 byte tokens, the end-of-document token and at least one merge
PLAIN_TEXT = DocumentSpec()  # .txt files, a document per file
PLAN_FORMAT = "jaxpar-tokenize-plan-1"
MIN_UNIT_BYTES = 1 << 16


def check_tokenize_args(inputs: list[InputFile], vocab_size: int | None, out: str, tokenizer: str | None,
                        spec: DocumentSpec = PLAIN_TEXT, shard: tuple[int, int] | None = None,
                        workers: int = 1, unit_bytes: int = UNIT_BYTES) -> None:
    """Every user mistake in `jaxpar tokenize`'s arguments, as one DataError sentence."""
    check_inputs(inputs, spec)
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}.")
    if unit_bytes < MIN_UNIT_BYTES:
        raise DataError(f"--unit-mb must be at least {MIN_UNIT_BYTES / 1e6:g}, got {unit_bytes / 1e6:g}.")
    if tokenizer is None:
        if vocab_size is None or not MIN_VOCAB <= vocab_size <= 2 ** 32:
            raise DataError(f"--vocab-size must be between {MIN_VOCAB} (the 256 bytes, the end-of-document token "
                            f"and one merge) and 2**32, got {vocab_size}; or give --tokenizer FILE to apply an "
                            f"existing tokenizer.")
        if shard is not None:
            raise DataError("--shard needs --tokenizer: each task would train a tokenizer of its own; train one "
                            "first (a run without --shard on a sample) and apply it with --tokenizer DIR.")
    else:
        tokenizer_json(tokenizer)
    if not is_free(Path(out)):
        raise DataError(f"--out '{out}' exists and is not an empty folder; choose a new one.")


def parse_shard(text: str) -> tuple[int, int]:
    """--shard 'i/n' as (i, n), 0 <= i < n."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise DataError(f"--shard must be i/n with 0 <= i < n (the i-th of n tasks), got '{text}'.")
    return int(index), int(count)


def _train(units: list[WorkUnit], vocab_size: int, progress: bool, spec: DocumentSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress, special_tokens=[EOD])

    def texts():
        for unit in units:
            for content, _ in unit_documents(unit, spec):
                if isinstance(content, list):  # a chat: its messages
                    yield from (m["content"] for m in content)
                else:
                    yield from (content if isinstance(content, tuple) else (content,))

    tokenizer.train_from_iterator(texts(), trainer)
    return tokenizer


def _job_key(inputs: list[InputFile], spec: DocumentSpec, vocab_size, tokenizer_file, shard_tokens, shard,
             unit_bytes: int) -> dict:
    """What decides a run's result, with the inputs' modification times: a rerun with the same key continues
    the interrupted one."""
    source = (hashlib.sha256(Path(tokenizer_file).read_bytes()).hexdigest() if tokenizer_file
              else f"trained, vocabulary {vocab_size}")
    return {"inputs": [[f.path, f.size, Path(f.path).stat().st_mtime_ns] for f in inputs], "spec": spec.__dict__,
            "tokenizer": source, "shard_tokens": shard_tokens, "shard": list(shard) if shard else None,
            "unit_bytes": unit_bytes}


def tokenize(inputs: list[str], out: str, vocab_size: int | None = None, tokenizer_file: str | None = None,
             progress: bool = True, shard_tokens: int = SHARD_TOKENS, spec: DocumentSpec = PLAIN_TEXT,
             workers: int = 1, shard: tuple[int, int] | None = None, unit_bytes: int = UNIT_BYTES) -> dict:
    """Tokenize the documents of `inputs` (files, folders, globs) into the folder `out` with `workers`
    processes, all of it or the `shard` = (i, n) task's part, in units of `unit_bytes`; returns its meta.json."""
    from tokenizers import Tokenizer

    files = expand_inputs(inputs)
    check_tokenize_args(files, vocab_size, out, tokenizer_file, spec, shard, workers, unit_bytes)
    tokenizer_file = str(tokenizer_json(tokenizer_file)) if tokenizer_file else None
    units = plan_units(files, spec, unit_bytes)
    partial = PartialFolder(Path(out), _job_key(files, spec, vocab_size, tokenizer_file, shard_tokens, shard,
                                                       unit_bytes))
    with partial.opened() as work:
        if partial.tokenizer is None:  # not saved by the interrupted run this one continues
            tokenizer = (Tokenizer.from_file(tokenizer_file) if tokenizer_file
                         else _train(units, vocab_size, progress, spec))
            partial.save_tokenizer(tokenizer, Path(tokenizer_file).parent if tokenizer_file else None)
        tokenizer = Tokenizer.from_file(str(partial.tokenizer))
        settings = tokenizer_settings(Path(tokenizer_file).parent if tokenizer_file else None)
        eod = end_of_document(tokenizer, settings)
        plan = _plan(files, units, spec, tokenizer, eod, partial.tokenizer, shard_tokens)
        mine = [u for u in units if shard is None or u.index % shard[1] == shard[0]]
        encoder = UnitEncoder(tokenizer, spec, settings, np.asarray([] if eod is None else [eod], np.int64),
                              plan["header"]["dtype"], shard_tokens)
        encode_units(encoder, mine, work, partial, workers, progress)
        records, ends = read_units(work, [u.index for u in mine])
        if shard is None:
            return partial.finish(finish(work, plan, records, ends))
        return partial.finish(shard_meta(plan, shard[0], shard[1], [u.index for u in mine]), keep_units=True)


def _plan(files, units, spec, tokenizer, eod, tokenizer_path: Path, shard_tokens: int) -> dict:
    """The run's plan: what every --shard task of it shares, and what its folder's meta.json says of it."""
    vocab = tokenizer.get_vocab_size()
    return {"format": PLAN_FORMAT, "inputs": [[f.path, f.kind, f.size] for f in files],
            "units": [[u.source.path, u.begin, u.end] for u in units], "spec": spec.__dict__,
            "tokenizer_sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest(), "shard_tokens": shard_tokens,
            "header": {"vocab_size": vocab, "dtype": token_dtype(vocab), "eod_id": eod, "loss_mask": spec.masked,
                       "preference": spec.preference}}
