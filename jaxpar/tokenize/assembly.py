"""A tokenized folder put together from its work units: documents.bin and meta.json over the units'
shards, in unit order; and `jaxpar tokenize --merge`, which puts the folders of a run's --shard tasks
together into the folder one process would have written, byte for byte.

A --shard task's folder holds its units' shards, each unit's document ends and record (units/), the
tokenizer, and a meta.json of format SHARD_FORMAT naming the run's plan and the task's place in it.
Training refuses such a folder (jaxpar.data.token_folder.read_meta): it is a part.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from jaxpar.data.folders import is_free, new_folder
from jaxpar.data.token_folder import COMPANION_FILES, FORMAT, META, SHARD_FORMAT, TOKENIZER
from jaxpar.errors import DataError
from jaxpar.tokenize.unit_encoding import UNITS, unit_ends, unit_record

DOCUMENTS = "documents.bin"


def document_ends(ends: list[np.ndarray], tokens: list[int]) -> np.ndarray:
    """The folder's document ends from its units' own (each from the unit's start) and token counts; an
    empty document (no tokens) at a unit's start is none, as it is within a unit."""
    offsets = np.cumsum([0, *tokens[:-1]], dtype=np.int64)
    shifted = [e + o for e, o in zip(ends, offsets)]
    whole = np.concatenate(shifted) if shifted else np.zeros(0, np.int64)
    return np.unique(whole[whole > 0])


def finish(folder: Path, plan: dict, records: list[dict], ends: list[np.ndarray]) -> dict:
    """Write documents.bin and meta.json into `folder` (whose shards the units wrote); returns the meta."""
    document_end = document_ends(ends, [r["tokens"] for r in records])
    if not len(document_end):
        raise DataError(f"the inputs {', '.join(f[0] for f in plan['inputs'])} hold no text to tokenize.")
    document_end.tofile(folder / DOCUMENTS)
    digest = hashlib.sha256("".join(r["sha256"] for r in records).encode()).hexdigest()
    header = plan["header"]
    meta = {"format": FORMAT, "vocab_size": header["vocab_size"], "dtype": header["dtype"],
            "tokens": sum(r["tokens"] for r in records), "shards": [s for r in records for s in r["shards"]],
            "documents": {"file": DOCUMENTS, "count": len(document_end)}, "eod_id": header["eod_id"],
            "loss_mask": header["loss_mask"], "preference": header["preference"],
            "inputs": [f[0] for f in plan["inputs"]], "inputs_sha256": digest, "tokenizer": TOKENIZER}
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_units(folder: Path, indices: list[int]) -> tuple[list[dict], list[np.ndarray]]:
    """The records and document ends of the units `indices` that `folder` holds."""
    try:
        records = [json.loads(unit_record(folder, i).read_text()) for i in indices]
        return records, [np.fromfile(unit_ends(folder, i), np.int64) for i in indices]
    except (OSError, ValueError):  # json's errors are ValueErrors
        raise DataError(f"'{folder}' lacks the record of a unit it should hold ({UNITS}/): it is not a whole "
                        f"--shard part.") from None


def shard_meta(plan: dict, index: int, count: int, units: list[int]) -> dict:
    return {"format": SHARD_FORMAT, "shard": {"index": index, "count": count}, "units": units, "plan": plan}


def merge(folders: list[str], out: str) -> dict:
    """Join the folders of a run's --shard tasks into `out`; returns its meta.json."""
    metas = _check_shards(folders, out)
    by_unit = {u: Path(folder) for folder, meta in zip(folders, metas) for u in meta["units"]}
    plan = metas[0]["plan"]
    indices = sorted(by_unit)
    if indices != list(range(len(plan["units"]))):
        raise DataError(f"the shard folders hold units {len(indices)} of the run's {len(plan['units'])}; give the "
                        f"folders of all its --shard tasks.")
    with new_folder(Path(out)) as work:
        first = Path(folders[0])
        for name in (TOKENIZER, *COMPANION_FILES):
            if (first / name).is_file():
                shutil.copyfile(first / name, work / name)
        records, ends = [], []
        for index in indices:
            (record,), (end,) = read_units(by_unit[index], [index])
            for shard in record["shards"]:
                for name in (shard["file"], shard.get("mask")):
                    if name and not (by_unit[index] / name).is_file():
                        raise DataError(f"--merge '{by_unit[index]}' lacks {name}: it is not a whole --shard part.")
                    if name:
                        _link_or_copy(by_unit[index] / name, work / name)
            records.append(record)
            ends.append(end)
        return finish(work, plan, records, ends)


def _check_shards(folders: list[str], out: str) -> list[dict]:
    """Every shard folder's meta, after the checks that they are the whole of one run."""
    metas = []
    for folder in folders:
        try:
            meta = json.loads(Path(folder, META).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            meta = None
        if (not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT or not isinstance(meta.get("plan"), dict)
                or not isinstance(meta.get("shard"), dict) or not isinstance(meta.get("units"), list)):
            raise DataError(f"--merge '{folder}' is not a folder that `jaxpar tokenize --shard` wrote.")
        metas.append(meta)
    tokenizers = [_digest(Path(folder, TOKENIZER)) for folder in folders]
    for folder, tokenizer, meta in zip(folders, tokenizers, metas):
        if tokenizer != tokenizers[0] or meta["plan"]["tokenizer_sha256"] != tokenizer:
            raise DataError(f"--merge '{folder}' was tokenized with another tokenizer than '{folders[0]}'; merge the "
                            f"shards of one run.")
        if meta["plan"] != metas[0]["plan"]:
            raise DataError(f"--merge '{folder}' and '{folders[0]}' are shards of different runs (their inputs or "
                            f"settings differ).")
    count, seen = metas[0]["shard"]["count"], [m["shard"]["index"] for m in metas]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    missing = sorted(set(range(count)) - set(seen))
    if twice or missing:
        what = f"shard {twice[0]}/{count} is given twice" if twice else f"shard {missing[0]}/{count} is missing"
        raise DataError(f"--merge: {what}; give the {count} folders of the run's --shard tasks once each.")
    if not is_free(Path(out)):
        raise DataError(f"--out '{out}' exists and is not an empty folder; choose a new one.")
    return metas


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        raise DataError(f"--merge '{path.parent}' has no {path.name}: it is not a whole --shard part.") from None


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (no bytes copied), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def drop_progress(folder: Path) -> None:
    """Remove a finished run's bookkeeping (units/) from its folder."""
    shutil.rmtree(folder / UNITS)
