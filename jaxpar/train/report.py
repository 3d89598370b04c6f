"""Run outputs rewritten whole: metrics.jsonl and summary.json, written so a reader never sees half a
file (lines are appended and read by jaxpar.runtime.jsonl; the loss-curve PNG is drawn by jaxpar.charts)."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
