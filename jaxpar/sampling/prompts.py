"""Prompts in, completions out: JSONL files of one record a line.

A prompt record has a `prompt` field (text) and any others, which travel with it: a GRPO reward reads
its answer from them (jaxpar.rl.rewards), and `jaxpar generate --prompts` copies them into each
completion's record, beside `completion`, `new_tokens` and `stopped`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxpar.errors import UserError

PROMPT_FIELD = "prompt"


def shortened(text: str, width: int = 60) -> str:
    """A prompt as an error sentence quotes it: its first `width` characters, on one line."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[:width - 3] + "...")


def read_prompts(path: str | Path) -> list[dict]:
    """The records of a prompts JSONL file, each with a non-empty text `prompt`; one sentence otherwise."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the prompts file {path}: {e}.") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"line {number} of {path} is not JSON ({e.msg}).") from None
        if not isinstance(record, dict) or not isinstance(record.get(PROMPT_FIELD), str) or not record[PROMPT_FIELD]:
            raise UserError(f"line {number} of {path} needs a non-empty text field {PROMPT_FIELD!r}.")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no prompts.")
    return records


def write_completions(path: str | Path, records: list[dict]) -> None:
    """Write the completion records as JSONL (through a temporary file: never half-written)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    partial.replace(path)
