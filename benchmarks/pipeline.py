"""Pipeline schedules on S=4 stages: bubble, FLOPs, temporaries and speed against M microbatches.

Usage:
    python benchmarks/pipeline.py [key=value ...] [--steps N] [--warmup W] [--schedules a,b] [--microbatches 4,8]

Model: jaxpar's defaults with `model.n_layers=8 train.batch_size=64`, then the key=value overrides.
For each schedule in {gpipe, 1f1b, 1f1b with parallel.pipeline.recompute=true, interleaved
(parallel.pipeline.virtual=2), 2bw} (or those --schedules names) and each number of microbatches M
in {4, 8, 16, 32} (or --microbatches), jaxpar's Trainer is built on mesh.data=2 x mesh.stage=4 (8
devices, emulated on a CPU-only host) and reported:
  * idle fraction: theoretical (S-1)/(v*M+S-1) (v=2 interleaved, else 1; 2bw's steady state: 0) and that
    of the schedule table the executor runs (`jaxpar.parallel.schedules.build(...).idle_fraction`), with its
    tick count;
  * FLOPs per device against the non-pipelined step of the same model and global batch on mesh.data=8,
    which gives every device the same share of the work (1/8 of the batch through the whole model, vs
    1/2 of the batch through 1/4 of the model):
      - static = flops_pipelined / flops_data8, both `measure_step(trainer)["flops"]`: compiled matmul
        FLOPs with loop trip counts. Every branch of a conditional counts on every execution, so for a
        pipelined step this is an upper bound: every branch of the tick `lax.switch` counts on every tick;
      - executed = `measure_step(trainer)["executed_flops"]` / flops_data8: each branch of the tick switch
        costed from its compiled computation and counted as often as the table takes it, averaged over
        devices. Expected: 1 for GPipe and for the schedules that keep each forward's residuals; 4/3 with
        recompute=true, where every backward redoes its forward (F + (F + B) against F + B, B = 2F);
  * temporaries per device (MiB, XLA's memory_analysis via `measure_step`);
  * tokens/s = batch_size * seq_len / median step time of N timed steps after W warm-up steps
    (compilation included in the warm-up; every step waited for with block_until_ready). A 2bw step
    finishes the previous step's microbatches and starts its own: after the warm-up (its first step
    fills the pipeline) every timed step is its steady state.
The data=8 reference is timed and measured the same way. Printed: a markdown table, then one JSON line
with every number; the figure goes to benchmarks/results/pipeline.png (idle fraction and temporaries vs M;
drawn only when every schedule runs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from common import (
    RESULTS,
    host_batches,
    markdown,
    parse_steps,
    pyplot,
    run_line,
    save_figure,
    step_parser,
    time_trainer,
    trainer_on,
)

from jaxpar.config.presets import load_config
from jaxpar.runtime.devices import setup_devices

STAGES, DATA, MICROBATCHES = 4, 2, (4, 8, 16, 32)
# label -> (schedule, virtual stages per device, recompute)
SCHEDULES = {"gpipe": ("gpipe", 1, False), "1f1b": ("1f1b", 1, False), "1f1b recompute": ("1f1b", 1, True),
             "interleaved": ("interleaved", 2, False), "2bw": ("2bw", 1, False)}
MODEL = ["model.n_layers=8", "train.batch_size=64"]
OUT_PNG = RESULTS / "pipeline.png"
MIB = 2 ** 20

PARSER = step_parser(__doc__, steps=5, warmup=2)
PARSER.add_argument("--schedules", default=",".join(SCHEDULES), help="the schedules to run, by label (default: all)")
PARSER.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)), help="the values of M (default: all)")
ARGS = parse_steps(PARSER)
if set(ARGS.schedules.split(",")) - set(SCHEDULES):
    PARSER.error(f"--schedules takes labels among {', '.join(SCHEDULES)}")
BASE = [f"run.dir={os.devnull}", *MODEL, *ARGS.overrides]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, BASE))

import numpy as np  # noqa: E402

from jaxpar.parallel.schedule_timing import formula_idle_fraction  # noqa: E402
from jaxpar.parallel.schedules import theoretical_idle_fraction  # noqa: E402
from jaxpar.plan import measure_step  # noqa: E402


def run_layout(label: str, overrides: list[str], batches: list[np.ndarray]) -> dict:
    """Build one layout's Trainer, measure its compiled step, then time it; returns the raw figures."""
    start = time.perf_counter()
    cfg = load_config(None, [*BASE, *overrides])
    trainer = trainer_on(cfg, DEVICES)
    plan = measure_step(trainer)
    seconds, _, _ = time_trainer(trainer, batches, ARGS.warmup)
    tokens = cfg.train.batch_size * cfg.model.seq_len
    print(f"{label}: {seconds * 1e3:.1f} ms/step, done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return {"flops": plan["flops"], "executed_flops": plan["executed_flops"], "temp_bytes": plan["temp_bytes"],
            "median_step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "table": trainer.pipeline.table}


def markdown_table(ref: dict, rows: list[dict]) -> str:
    """The markdown table: one row per (schedule, M), then the data=8 reference."""
    header = ["schedule", "M", "ticks", "idle theory", "idle table", "static FLOPs / data=8",
              "executed FLOPs / data=8", "temp MiB", "step ms", "tokens/s"]
    cells = [[r["label"] + (f" (v={r['virtual']})" if r["virtual"] > 1 else ""), str(r["M"]), str(r["ticks"]),
              f"{r['idle_theory']:.3f}", f"{r['idle_table']:.3f}", f"{r['static_flops_ratio']:.3f}",
              f"{r['executed_flops_ratio']:.3f}", f"{r['temp_mib']:.2f}", f"{r['median_step_ms']:.1f}",
              f"{r['tokens_per_s']:,.0f}"] for r in rows]
    cells.append(["none (data=8)", "-", "-", "0", "-", "1.000", "1.000", f"{ref['temp_mib']:.2f}",
                  f"{ref['median_step_ms']:.1f}", f"{ref['tokens_per_s']:,.0f}"])
    return markdown(header, cells)


def plot(ref: dict, rows: list[dict], path: Path) -> None:
    """Two panels against M: idle fraction per schedule with theory dashed (left), temporary MiB (right)."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(13, 5))
    for (name, (_, virtual, _)), marker in zip(SCHEDULES.items(), "osxD^"):
        mine = [r for r in rows if r["label"] == name]
        if not mine:
            continue
        label = name + (f" (v={virtual})" if virtual > 1 else "")
        left.plot([r["M"] for r in mine], [r["idle_table"] for r in mine], marker=marker, label=f"{label}, table")
        right.plot([r["M"] for r in mine], [r["temp_mib"] for r in mine], marker=marker, label=label)
    for virtual, color in zip(sorted({v for _, v, _ in SCHEDULES.values()}), ("black", "gray")):
        left.plot(MICROBATCHES, [theoretical_idle_fraction(STAGES, m, virtual) for m in MICROBATCHES], "--",
                  color=color, label=f"theory (S-1)/({virtual if virtual > 1 else ''}M+S-1)")
    right.axhline(ref["temp_mib"], color="gray", ls=":", label="no pipeline (data=8)")
    right.set_yscale("log")
    same = len({tuple(r["idle_table"] for r in rows if r["label"] == name)
                for name, (_, v, _) in SCHEDULES.items() if v == 1})
    note = " (the v=1 tables coincide)" if same == 1 else ""
    for ax, ylabel, title in ((left, "idle fraction", f"Pipeline bubble, S={STAGES}{note}"),
                              (right, "temporary MiB per device", f"Temporaries, data={DATA} x stage={STAGES}")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(MICROBATCHES, [str(m) for m in MICROBATCHES])
        ax.set_xlabel("microbatches M")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> int:
    """Run the data=8 reference and every (schedule, M), print the table and JSON, write the figure."""
    cfg = load_config(None, BASE)
    batches = host_batches(cfg, ARGS.warmup + ARGS.steps)
    print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps) + " per layout", file=sys.stderr)
    ref = run_layout("data=8", ["mesh.data=8", "mesh.stage=1"], batches)
    ref.pop("table")
    ref["temp_mib"] = ref["temp_bytes"] / MIB
    rows = []
    chosen = {name: SCHEDULES[name] for name in ARGS.schedules.split(",")}
    for name, (schedule, virtual, recompute) in chosen.items():
        for m in map(int, ARGS.microbatches.split(",")):
            got = run_layout(f"{name} M={m}", [f"mesh.data={DATA}", f"mesh.stage={STAGES}",
                                               f"parallel.pipeline.schedule={schedule}",
                                               f"parallel.pipeline.microbatches={m}",
                                               f"parallel.pipeline.virtual={virtual}",
                                               f"parallel.pipeline.recompute={str(recompute).lower()}"], batches)
            table = got.pop("table")
            rows.append({"label": name, "schedule": schedule, "virtual": virtual, "recompute": recompute, "M": m,
                         "ticks": len(table.ticks), "idle_theory": formula_idle_fraction(schedule, STAGES, m, virtual),
                         "idle_table": table.idle_fraction, "static_flops_ratio": got["flops"] / ref["flops"],
                         "executed_flops_ratio": got["executed_flops"] / ref["flops"],
                         "temp_mib": got["temp_bytes"] / MIB, **got})
    print(f"Pipeline, S={STAGES} on data={DATA} x stage={STAGES} ({' '.join(BASE[1:])}); "
          f"FLOPs relative to data=8 (flops_data8 = {ref['flops']:.4g} per device)\n")
    print(markdown_table(ref, rows) + "\n")
    if len(chosen) == len(SCHEDULES):  # the figure compares every schedule
        plot(ref, rows, OUT_PNG)
        print(f"figure: {OUT_PNG}", file=sys.stderr)
    print(json.dumps({"overrides": BASE[1:], "stages": STAGES, "data": DATA, "reference_data8": ref, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
