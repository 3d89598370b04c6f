"""Run outputs: metrics.jsonl lines and summary.json, written so a reader never sees half a file
(the loss-curve PNG is drawn by jaxpar.charts)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_jsonl(path: Path, record: dict) -> None:
    """Append one JSON object as a line."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file; a line cut short by a killed process is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_jsonl_atomic(path: Path, records: list[dict]) -> None:
    """Replace a .jsonl file with `records` (atomically)."""
    _write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON atomically."""
    _write_text_atomic(path, json.dumps(data, indent=2) + "\n")
