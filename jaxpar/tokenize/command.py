"""The `jaxpar tokenize` command: its flags as a run of jaxpar.tokenize.folder, or a --merge of --shard parts
(jaxpar.tokenize.assembly), and what it prints."""

from __future__ import annotations

import argparse
import json
import math

from jaxpar.config import ConfigError
from jaxpar.tokenize.assembly import merge
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.tokenize.folder import MIN_UNIT_BYTES, parse_shard, tokenize

SUMMARY_KEYS = ("vocab_size", "dtype", "tokens", "inputs_sha256")  # the JSON line that ends the output


def run_tokenize(args: argparse.Namespace) -> int:
    """`jaxpar tokenize`: --input (a whole run, or with --shard one task's part) or --merge; prints what it wrote."""
    if bool(args.merge) == bool(args.input):
        raise ConfigError("give --input PATH ... to tokenize, or --merge DIR ... to join the folders of --shard tasks; "
                          "one of the two.")
    if args.merge:
        meta = merge(args.merge, args.out)
        print(f"{meta['tokens']:,} tokens in {meta['documents']['count']:,} documents from {len(args.merge)} shard "
              f"folders under {args.out}/; train on them with data.source={args.out} "
              f"model.vocab_size={meta['vocab_size']}")
        print(json.dumps({k: meta[k] for k in SUMMARY_KEYS}))
        return 0
    field = args.field or args.column or ("messages" if args.chat else None)
    chats = args.preference and args.chat  # preference conversations: their fields default to chosen, rejected
    spec = DocumentSpec(split=args.split, field=field, sft=args.sft, prompt=args.field_prompt,
                        response=args.field_response, chat=args.chat, preference=args.preference,
                        chosen=args.field_chosen or ("chosen" if chats else None),
                        rejected=args.field_rejected or ("rejected" if chats else None))
    shard = parse_shard(args.shard) if args.shard else None
    if not (math.isfinite(args.unit_mb) and args.unit_mb * 1e6 >= MIN_UNIT_BYTES):
        raise ConfigError(f"--unit-mb must be a number of MB, at least {MIN_UNIT_BYTES / 1e6:g}; got {args.unit_mb:g}.")
    meta = tokenize(args.input, args.out, args.vocab_size, args.tokenizer, progress=not args.no_progress, spec=spec,
                    workers=args.workers, shard=shard, unit_bytes=int(args.unit_mb * 1e6))
    if shard:
        print(f"part {shard[0]}/{shard[1]} ({len(meta['units'])} of {len(meta['plan']['units'])} units) under "
              f"{args.out}/; join the {shard[1]} parts with `jaxpar tokenize --merge DIR ... --out DIR`")
        return 0
    count, detail = meta["documents"]["count"], f"{meta['dtype']}, vocabulary {meta['vocab_size']}"
    pairs = f"{count // 2:,} preference pairs, each chosen then rejected; " if spec.preference else ""
    print(f"{meta['tokens']:,} tokens in {count:,} documents ({pairs}{detail}) in {len(meta['shards'])} shard(s) "
          f"under {args.out}/; train on them with data.source={args.out} model.vocab_size={meta['vocab_size']}"
          + (" data.packing=pack train.objective=dpo (or simpo, orpo)" if spec.preference
             else " data.packing=pack (the loss is on the responses)" if spec.masked else ""))
    print(json.dumps({k: meta[k] for k in SUMMARY_KEYS}))
    return 0
