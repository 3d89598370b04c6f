"""Charts as PNG files: matplotlib off screen, imported on first use (only what plots pays for it),
each written via a temporary file and renamed."""

from __future__ import annotations

import os
from pathlib import Path


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
