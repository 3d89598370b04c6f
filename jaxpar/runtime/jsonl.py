"""JSON-lines files (metrics.jsonl, timeline.jsonl), appended a line at a time and read back whole.
Pure Python (no jax): the launcher reads a run's timeline without the training stack."""

from __future__ import annotations

import json
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
