"""Run outputs: metrics.jsonl lines, summary.json and the loss-curve PNG."""

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


def pyplot():
    """matplotlib.pyplot drawing off screen (imported on first use: only runs that plot pay for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> None:
    """Write a figure as a PNG via a temporary file and rename, and close it."""
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    pyplot().close(fig)
    os.replace(tmp, path)


def plot_loss(records: list[dict], val_loss: float | None, path: Path) -> None:
    """Training loss against step, the validation loss of the steps that measured it
    (train.eval_every) as a second curve, and the final validation loss marked, as a PNG."""
    fig, ax = pyplot().subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss")
    evaluated = [r for r in records if "val_loss" in r]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], color="C1", marker="o",
                markersize=3, label="validation loss")
    if val_loss is not None and records:
        ax.scatter([records[-1]["step"]], [val_loss], color="C3", zorder=3, label=f"validation {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)
