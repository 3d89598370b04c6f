"""Zero-bubble pipelines against 1F1B on S=4 stages: the step time each table predicts from its
branches' compiled costs, beside the measured CPU step time.

Usage:
    python benchmarks/zero_bubble.py [key=value ...] [--steps N] [--warmup W] [--rounds R]

Model: jaxpar's defaults with `model.n_layers=8 train.batch_size=64` on mesh.data=2 x mesh.stage=4,
then the key=value overrides. For 1f1b, zb-h1 and zbv at M in {8, 16}:
  * the cost of each branch of the tick switch (idle, F, B and W of the first, a middle and the last
    chunk; 1F1B's B is a fused backward), read from the compiled step: its matmul FLOPs and the bytes
    its other work writes (jaxpar.plan.hlo.branch_costs), as seconds on a hardware profile (FLOPs at
    its peak, bytes at its write bandwidth), and the same for the rest of the step (the update);
  * predicted step = the rest + the table in lockstep: each tick lasts as long as the slowest
    stage's branch, which is how the SPMD program runs it (one `lax.switch` per tick on every
    device, then the stages' ppermutes). Also given: the ideal asynchronous timeline (each stage
    running as soon as its inputs are ready, the paper's model, jaxpar.parallel.schedule_timing);
  * on the measured `cpu` profile and on the h100 profile (the same compiled costs);
  * measured: the median step time over R rounds that alternate the layouts, each round the
    median of N steps after W warm-up steps (the first round's warm-up compiles).
Emulated CPU devices share the host's cores, so a stage that idles frees its core for a busy one
and the bubble barely shows in wall time: the prediction is what devices that work in parallel
would see. Printed: a markdown table, then one JSON line with every number.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

from common import host_batches, markdown, parse_steps, run_line, step_parser, time_steps, trainer_on

from jaxpar.presets import load_config
from jaxpar.runtime import setup_devices

STAGES, DATA, MICROBATCHES, SCHEDULES = 4, 2, (8, 16), ("1f1b", "zb-h1", "zbv")
MODEL = ["model.n_layers=8", "train.batch_size=64"]

PARSER = step_parser(__doc__, steps=3, warmup=1)
PARSER.add_argument("--rounds", type=int, default=3, help="alternating rounds of every layout (default %(default)s)")
ARGS = parse_steps(PARSER)
BASE = [f"run.dir={os.devnull}", *MODEL, *ARGS.overrides]
# jax must not start before setup_devices has set XLA_FLAGS (emulated CPU devices).
DEVICES = setup_devices(load_config(None, BASE))

from jaxpar.parallel.pipeline import BRANCHES, TICK_SCOPE, branch_of  # noqa: E402
from jaxpar.parallel.schedule_timing import idle_fraction, timeline  # noqa: E402
from jaxpar.plan.calibrate import profile  # noqa: E402
from jaxpar.plan.hlo import branch_costs, matmul_flops, parse, written_bytes  # noqa: E402
from jaxpar.plan.memory import PLAN_COMPILER_OPTIONS  # noqa: E402


def compiled_costs(trainer) -> dict:
    """Per-branch and rest-of-step matmul FLOPs and written bytes of the trainer's compiled step."""
    module = parse(trainer.compile_step(PLAN_COMPILER_OPTIONS.get("cpu")).as_text())
    flops, rest_flops = branch_costs(module, TICK_SCOPE, matmul_flops)
    written, rest_written = branch_costs(module, TICK_SCOPE, written_bytes)
    return {"branch_flops": flops, "branch_written_bytes": written, "rest_flops": rest_flops,
            "rest_written_bytes": rest_written}


def predicted(table, costs: dict, hardware, precision: str) -> dict:
    """Seconds of the step on `hardware`: the rest plus the table's ticks in lockstep, and the
    ideal asynchronous timeline instead of the lockstep, from the per-branch costs."""
    peak, bandwidth = hardware.peak_flops[precision], hardware.write_bandwidth
    seconds = [f / peak + b / bandwidth for f, b in zip(costs["branch_flops"], costs["branch_written_bytes"])]
    rest = costs["rest_flops"] / peak + costs["rest_written_bytes"] / bandwidth
    last = table.stages * table.virtual - 1
    lockstep = sum(max(seconds[branch_of(a, last)] for a in row) for row in table.ticks)

    def cost(action):
        return seconds[branch_of(action, last)]

    makespan = max(end for stage in timeline(table, cost) for _, _, end in stage)
    return {"lockstep_s": rest + lockstep, "asynchronous_s": rest + makespan, "timed_idle": idle_fraction(table, cost),
            "branch_ms": {BRANCHES[k]: 1e3 * s for k, s in enumerate(seconds)}}


def main() -> int:
    cfg = load_config(None, BASE)
    batches = host_batches(cfg, ARGS.warmup + ARGS.steps)
    print(run_line(DEVICES, cfg, ARGS.warmup, ARGS.steps) + f" per layout and round, {ARGS.rounds} rounds",
          file=sys.stderr)
    cpu, h100 = profile("cpu", DEVICES), profile("h100", DEVICES)
    layouts = {}
    for m in MICROBATCHES:
        for schedule in SCHEDULES:
            layout_cfg = load_config(None, [*BASE, f"mesh.data={DATA}", f"mesh.stage={STAGES}",
                                            f"parallel.pipeline.schedule={schedule}",
                                            f"parallel.pipeline.microbatches={m}"])
            trainer = trainer_on(layout_cfg, DEVICES)
            costs = compiled_costs(trainer)
            table, precision = trainer.pipeline.table, layout_cfg.train.precision
            layouts[schedule, m] = {"trainer": trainer, "state": trainer.init(), "rounds": [], "costs": costs,
                                    "ticks": len(table.ticks), "idle_table": table.idle_fraction,
                                    "cpu": predicted(table, costs, cpu, precision),
                                    "h100": predicted(table, costs, h100, precision)}
    for _ in range(ARGS.rounds):  # alternate the layouts, so that the host's drift hits all alike
        for (schedule, m), run in layouts.items():
            trainer = run["trainer"]
            seconds, _, run["state"] = time_steps(trainer.step, run["state"], trainer.put_batch, batches, ARGS.warmup)
            run["rounds"].append(seconds)
            print(f"{schedule} M={m}: {seconds * 1e3:.1f} ms", file=sys.stderr)
    rows, report = [], []
    for (schedule, m), run in layouts.items():
        measured = statistics.median(run["rounds"])
        one = layouts["1f1b", m]
        ratio = {p: run[p]["lockstep_s"] / one[p]["lockstep_s"] for p in ("cpu", "h100")}
        measured_ratio = measured / statistics.median(one["rounds"])
        rows.append([schedule, m, run["ticks"], f"{run['idle_table']:.3f}", f"{run['cpu']['lockstep_s'] * 1e3:.1f}",
                     f"{run['cpu']['asynchronous_s'] * 1e3:.1f}", f"{ratio['cpu']:.3f}", f"{ratio['h100']:.3f}",
                     f"{measured * 1e3:.1f}", f"{measured_ratio:.3f}"])
        report.append({"schedule": schedule, "M": m, "ticks": run["ticks"], "idle_table": run["idle_table"],
                       "costs": run["costs"], "cpu": run["cpu"], "h100": run["h100"], "measured_s": measured,
                       "measured_rounds_s": run["rounds"], "predicted_vs_1f1b": ratio,
                       "measured_vs_1f1b": measured_ratio})
    header = ["schedule", "M", "ticks", "idle (table)", "predicted ms (cpu, lockstep)", "predicted ms (cpu, async)",
              "predicted / 1F1B (cpu)", "predicted / 1F1B (h100)", "measured ms (cpu)", "measured / 1F1B"]
    print(f"Zero bubble against 1F1B, S={STAGES} on data={DATA} x stage={STAGES} ({' '.join(BASE[1:])})\n")
    print(markdown(header, rows) + "\n")
    print(json.dumps({"overrides": BASE[1:], "rounds": ARGS.rounds, "steps": ARGS.steps, "warmup": ARGS.warmup,
                      "rows": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
