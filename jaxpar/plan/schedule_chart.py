"""Draw a pipeline schedule table as a Gantt chart (devices by ticks), like the GPipe and
PipeDream papers' figures: forwards and backwards coloured and labelled with their
microbatch, bubbles left blank."""

from __future__ import annotations

from pathlib import Path

from jaxpar.parallel.schedules import Table, theoretical_idle_fraction

_FORWARD = ("#4C72B0", "#8FAADC")   # by local chunk (interleaved): dark, light
_BACKWARD = ("#DD8452", "#F4B183")


def text_chart(table: Table) -> str:
    """The table as text: one line per stage, F3/B3 per tick (with .c for the chunk when interleaved)."""
    def cell(action) -> str:
        if action is None:
            return " .  "
        tag = f"{action.kind}{action.microbatch}"
        if table.virtual > 1:
            tag += f".{action.chunk // table.stages}"
        return f"{tag:<4}"

    return "\n".join(f"stage {s}: " + "".join(cell(row[s]) for row in table.ticks) for s in range(table.stages))


def draw(table: Table, path: str | Path) -> None:
    """Write the Gantt chart PNG (atomically: a temporary file, then rename)."""
    from matplotlib.patches import Patch

    from jaxpar.charts import pyplot, save_png

    ticks = len(table.ticks)
    fig, ax = pyplot().subplots(figsize=(max(6.0, 0.32 * ticks + 1.5), 0.55 * table.stages + 1.6), dpi=110)
    for t, row in enumerate(table.ticks):
        for s, action in enumerate(row):
            if action is None:
                continue
            shade = (action.chunk // table.stages) % 2
            color = (_FORWARD if action.kind == "F" else _BACKWARD)[shade]
            ax.broken_barh([(t, 1)], (table.stages - 1 - s, 0.9), facecolors=color, edgecolor="white", linewidth=0.6)
            ax.text(t + 0.5, table.stages - 1 - s + 0.45, str(action.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_xlim(0, ticks)
    ax.set_ylim(-0.1, table.stages)
    ax.set_yticks([table.stages - 1 - s + 0.45 for s in range(table.stages)])
    ax.set_yticklabels([f"device {s}" for s in range(table.stages)])
    ax.set_xlabel("time (ticks: one chunk's forward or backward)")
    virtual = f", v={table.virtual}" if table.virtual > 1 else ""
    ax.set_title(f"{table.schedule}: S={table.stages}, M={table.microbatches}{virtual}, "
                 f"idle fraction {table.idle_fraction:.4f}", fontsize=10)
    ax.legend(handles=[Patch(color=_FORWARD[0], label="forward"), Patch(color=_BACKWARD[0], label="backward")],
              loc="upper right", fontsize=8, ncol=2, bbox_to_anchor=(1.0, 1.32 if table.stages < 3 else 1.18))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)


def summary(table: Table) -> dict:
    """The JSON line printed by `jaxpar schedule`."""
    return {"schedule": table.schedule, "stages": table.stages, "microbatches": table.microbatches,
            "virtual": table.virtual, "ticks": len(table.ticks), "idle_fraction": table.idle_fraction,
            "theoretical_idle_fraction": theoretical_idle_fraction(table.stages, table.microbatches, table.virtual),
            "max_in_flight": max(table.in_flight(s) for s in range(table.stages))}
