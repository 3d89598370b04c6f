"""Draw a pipeline schedule table as a Gantt chart (devices by time), like the GPipe, PipeDream
and zero-bubble papers' figures: forwards, backwards and (zero-bubble schedules) weight
backwards coloured and labelled with their microbatch, bubbles left blank. Each action is as
wide as its cost (default F = B = W = 1, a fused backward B + W) and starts as soon as its stage
and its inputs allow (jaxpar.parallel.schedule_timing)."""

from __future__ import annotations

from pathlib import Path

from jaxpar.parallel.schedule_timing import Costs, bubble, formula_idle_fraction, idle_fraction, paper_bubble, timeline
from jaxpar.parallel.schedules import Table, build, run_idle_fraction, run_tables, two_steps

_FORWARD = ("#4C72B0", "#8FAADC")   # by local chunk (interleaved, zbv): dark, light
_BACKWARD = ("#DD8452", "#F4B183")
_WEIGHT = ("#55A868", "#A9D18E")
UNIT = Costs()  # F = B = W = 1


def text_chart(table: Table) -> str:
    """The table as text: one line per stage, F3/B3/W3 per tick (with .c for the local chunk when a
    stage holds several)."""
    def cell(action) -> str:
        if action is None:
            return " .  "
        tag = f"{action.kind}{action.microbatch}"
        if table.virtual > 1:
            tag += f".{table.local_chunk(action.chunk)}"
        return f"{tag:<4}"

    return "\n".join(f"stage {s}: " + "".join(cell(row[s]) for row in table.ticks) for s in range(table.stages))


def draw(table: Table, path: str | Path, costs: Costs = UNIT) -> None:
    """Write the Gantt chart PNG (atomically: a temporary file, then rename)."""
    from matplotlib.patches import Patch

    from jaxpar.charts import pyplot, save_png

    spans = timeline(table, costs.of(table))
    end = max(stop for stage in spans for _, _, stop in stage)
    fig, ax = pyplot().subplots(figsize=(max(6.0, 0.32 * end + 1.5), 0.55 * table.stages + 1.6), dpi=110)
    colours = {"F": _FORWARD, "B": _BACKWARD, "W": _WEIGHT}
    for s, stage in enumerate(spans):
        for action, start, stop in stage:
            # shades: a stage's chunks (interleaved, zbv), or 2BW's consecutive steps
            two_bw = table.schedule == "2bw"
            shade = action.microbatch // table.microbatches if two_bw else table.local_chunk(action.chunk)
            color = colours[action.kind][shade % 2]
            ax.broken_barh([(start, stop - start)], (table.stages - 1 - s, 0.9), facecolors=color, edgecolor="white",
                           linewidth=0.6)
            ax.text((start + stop) / 2, table.stages - 1 - s + 0.45, str(action.microbatch), ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_xlim(0, end)
    ax.set_ylim(-0.1, table.stages)
    ax.set_yticks([table.stages - 1 - s + 0.45 for s in range(table.stages)])
    ax.set_yticklabels([f"device {s}" for s in range(table.stages)])
    ax.set_xlabel(f"time (one chunk's F = {costs.forward:g}, B = {costs.backward:g}, W = {costs.weight:g}"
                  + ("" if table.split_backward else "; a backward is B + W") + ")")
    virtual = f", v={table.virtual}" if table.virtual > 1 else ""
    steps = ", steady state over two steps (shades: steps)" if table.schedule == "2bw" else ""
    ax.set_title(f"{table.schedule}{steps}: S={table.stages}, M={table.microbatches}{virtual}, "
                 f"idle fraction {idle_fraction(table, costs.of(table)):.4f}", fontsize=10)
    handles = [Patch(color=_FORWARD[0], label="forward"),
               Patch(color=_BACKWARD[0], label="backward (input)" if table.split_backward else "backward")]
    if table.split_backward:
        handles.append(Patch(color=_WEIGHT[0], label="backward (weights)"))
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles),
              bbox_to_anchor=(1.0, 1.32 if table.stages < 3 else 1.18))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)


def chart_table(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Table:
    """The table `jaxpar schedule` draws: one step, or for 2bw two steps of its steady state (microbatches
    numbered from the first step's previous one: 0 .. 3M-1)."""
    return two_steps(stages, microbatches) if schedule == "2bw" else build(schedule, stages, microbatches, virtual)


def run_summary(stages: int, microbatches: int, steps: int) -> dict:
    """2BW over a run of `steps` steps: the first fills the pipeline and a drain empties it after the last,
    against 1F1B, which fills and drains at every step."""
    return {"run_steps": steps, "run_idle_fraction": run_idle_fraction(run_tables(stages, microbatches, steps)),
            "1f1b_idle_fraction": build("1f1b", stages, microbatches).idle_fraction}


def summary(table: Table, costs: Costs = UNIT) -> dict:
    """The JSON line printed by `jaxpar schedule`: the table's idle fraction (each action one tick),
    its formula, and with the actions' costs the timed idle fraction and the paper's bubble (the most
    idle time inside one stage's span, in units of the costs) against Qi et al.'s formula."""
    cost = costs.of(table)
    return {"schedule": table.schedule, "stages": table.stages, "microbatches": table.microbatches,
            "virtual": table.virtual, "ticks": len(table.ticks), "idle_fraction": table.idle_fraction,
            "theoretical_idle_fraction": formula_idle_fraction(table.schedule, table.stages, table.microbatches,
                                                               table.virtual),
            "max_in_flight": max(table.in_flight(s) for s in range(table.stages)),
            "costs": [costs.forward, costs.backward, costs.weight],
            "timed_idle_fraction": idle_fraction(table, cost), "bubble": bubble(table, cost),
            "paper_bubble": paper_bubble(table.schedule, table.stages, costs)}
