"""Run outputs rewritten whole: metrics.jsonl and summary.json, written so a reader never sees half a
file (lines are appended and read by jaxpar.runtime.jsonl; the loss-curve PNG is drawn by jaxpar.charts)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxpar.data.folders import write_atomically


def write_jsonl_atomic(path: Path, records: list[dict]) -> None:
    """Replace a .jsonl file with `records` (atomically)."""
    write_atomically(path, "".join(json.dumps(r) + "\n" for r in records))


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON atomically."""
    write_atomically(path, json.dumps(data, indent=2) + "\n")
